#!/usr/bin/env bash
# A throw-away, real Slurm cluster on this one machine for the Slurm tests and for trying GPU Medic
# against Slurm by hand: a private munged, one slurmctld and one slurmd per node, all on 127.0.0.1
# (Debian's Slurm is built with MULTIPLE_SLURMD, so each node is a slurmd with its own port).
# Needs root and the packages from scripts/install-slurm.sh; no systemd. Reboot requests are served by
# a stand-in that needs Linux time namespaces (kernel >= 5.6, `unshare --time`).
#
# usage: scripts/slurm-cluster.sh start|stop|status
# env:   SLURM_TEST_BASE       where config, state, logs and pid files go   (/tmp/medic-slurm);
#                              it and its parents must be searchable by all (munged checks)
#        SLURM_TEST_NODES      number of nodes gpu-node-1..N                 (4)
#        SLURM_TEST_GPUS       fake GPUs (gres gpu) per node, 0 for none     (8)
#        SLURM_TEST_CTLD_PORT  slurmctld's port                              (16817)
#        SLURM_TEST_NODE_PORT0 node i listens on PORT0+i                      (17000)
# Clients then need: export SLURM_CONF=$SLURM_TEST_BASE/etc/slurm.conf
set -euo pipefail

base=${SLURM_TEST_BASE:-/tmp/medic-slurm}
nodes=${SLURM_TEST_NODES:-4}
gpus=${SLURM_TEST_GPUS:-8}
ctld_port=${SLURM_TEST_CTLD_PORT:-16817}
port0=${SLURM_TEST_NODE_PORT0:-17000}
conf=$base/etc/slurm.conf
run=$base/run
log=$base/log
munge_socket=$run/munge.socket
self=$(readlink -f "$0")
export SLURM_CONF=$conf

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
# Poll up to 30 s for a command to succeed.
await() { for _ in $(seq 1 300); do "$@" && return 0; sleep 0.1; done; return 1; }

write_conf() {
  mkdir -p "$base"/{etc,state/ctld,log,run,munge}
  chmod 755 "$base" "$run" # munged refuses a socket in a directory others cannot search
  cat >"$conf" <<EOF
# written by scripts/slurm-cluster.sh
ClusterName=medictest
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Our own munged, not the system's. A requeued job may start again only after its old credential
# expires: 10 s instead of the default 120 s keeps requeue tests short.
AuthInfo=socket=$munge_socket,cred_expire=10
StateSaveLocation=$base/state/ctld
# %n: every slurmd gets its own spool, pid and log file
SlurmdSpoolDir=$base/state/d/%n
SlurmctldPidFile=$run/slurmctld.pid
SlurmdPidFile=$run/slurmd-%n.pid
SlurmctldLogFile=$log/slurmctld.log
SlurmdLogFile=$log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No mail server here; without this slurmctld logs "Configured MailProg is invalid".
MailProg=/bin/true
# No cgroups in a container: track job processes by parent pid.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# 1, not 2: with 2 an admin's "state=down" is undone as soon as the slurmd registers again.
ReturnToService=1
SlurmdTimeout=30
SlurmctldTimeout=30
KillWait=2
MinJobAge=300
# slurmd runs this for "scontrol reboot": a stand-in that restarts the node's slurmd as if the
# machine had booted (see fake_reboot below); nothing here may really reboot.
RebootProgram=$base/bin/fake-reboot
EOF
  mkdir -p "$base/bin"
  printf '#!/bin/bash\nSLURM_TEST_BASE=%q exec %q fake-reboot\n' "$base" "$self" >"$base/bin/fake-reboot"
  chmod 755 "$base/bin/fake-reboot"
  local node_gres=""
  rm -f "$base/etc/gres.conf"
  if [ "$gpus" -gt 0 ]; then
    # gres/gpu drops GPUs without a device file (the node then goes "inval"), so give each fake
    # GPU a plain empty file; with TaskPlugin=task/none nothing opens it.
    mkdir -p "$base/fakegpu"
    for k in $(seq 0 $((gpus - 1))); do : >"$base/fakegpu/nvidia$k"; done
    echo "GresTypes=gpu" >>"$conf"
    echo "NodeName=gpu-node-[1-$nodes] Name=gpu File=$base/fakegpu/nvidia[0-$((gpus - 1))]" >"$base/etc/gres.conf"
    node_gres=" Gres=gpu:$gpus"
  fi
  for i in $(seq 1 "$nodes"); do
    echo "NodeName=gpu-node-$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port0 + i)) CPUs=2 RealMemory=1000$node_gres State=UNKNOWN" >>"$conf"
    mkdir -p "$base/state/d/gpu-node-$i"
  done
  echo "PartitionName=gpu Nodes=gpu-node-[1-$nodes] Default=YES MaxTime=INFINITE State=UP" >>"$conf"
}

idle_nodes() { sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle" { print $1 }' | sort -u | wc -l; }
all_idle() { [ "$(idle_nodes)" -ge "$nodes" ]; }
ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }
no_running_jobs() { [ -z "$(squeue -h -t running,completing -o %i 2>/dev/null)" ]; }

# A half-started cluster is worse than none: stop what came up, keep the logs.
start_failed() {
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "start failed (rc=$rc), logs in $log" >&2
    stop >&2 || true
  fi
}

start() {
  local t0 t
  t0=$(now)
  for pidfile in "$run"/*.pid; do
    if alive "$pidfile"; then
      echo "a cluster is already running in $base ($pidfile)" >&2
      exit 1
    fi
  done
  trap start_failed EXIT
  rm -rf "$base/state" "$run" # no jobs or node states from an earlier run
  write_conf
  [ -s "$base/munge/munge.key" ] || {
    dd if=/dev/urandom of="$base/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$base/munge/munge.key"
  }
  t=$(now)
  munged --socket="$munge_socket" --key-file="$base/munge/munge.key" --log-file="$log/munged.log" \
    --pid-file="$run/munged.pid" --seed-file="$base/munge/munged.seed"
  munge -S "$munge_socket" -n | unmunge -S "$munge_socket" >/dev/null
  echo "munged up in $(since "$t") s"

  t=$(now)
  slurmctld -f "$conf"
  await ctld_up || { echo "slurmctld did not answer; see $log/slurmctld.log" >&2; exit 1; }
  echo "slurmctld answering in $(since "$t") s"

  t=$(now)
  for i in $(seq 1 "$nodes"); do slurmd -f "$conf" -N "gpu-node-$i"; done
  # Ready means every node is exactly "idle": not idle* (not responding), inval or drained.
  await all_idle || { echo "not all nodes idle; see $log/" >&2; sinfo -N -R >&2; exit 1; }
  echo "$nodes nodes idle $(since "$t") s after their slurmd started; cluster up in $(since "$t0") s"
  trap - EXIT
}

# SIGTERM every daemon in the given pid files at once (one after another takes ~4x longer),
# wait up to 15 s, then SIGKILL what is left.
stop_pids() {
  local pids=() pidfile pid
  for pidfile in "$@"; do [ -f "$pidfile" ] && pids+=("$(cat "$pidfile")"); done
  [ ${#pids[@]} -eq 0 ] && return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 1 150); do
    local left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ $left = 0 ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null && { echo "killing $pid" >&2; kill -KILL "$pid" 2>/dev/null || true; }
  done
  rm -f "$@"
}

stop() {
  local t0 jobs
  t0=$(now)
  shopt -s nullglob
  if alive "$run/slurmctld.pid"; then
    # Cancel through Slurm first so job steps end cleanly instead of being orphaned.
    jobs=$(squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086 # one argument per job id
      scancel $jobs 2>/dev/null || true
      await no_running_jobs || true
    fi
  fi
  stop_pids "$run"/slurmd-*.pid "$run"/slurmctld.pid
  stop_pids "$run"/munged.pid
  echo "cluster in $base stopped in $(since "$t0") s"
}

status() {
  local pidfile running=0
  for pidfile in "$run"/*.pid; do
    [ -f "$pidfile" ] || continue
    if alive "$pidfile"; then
      echo "$(basename "$pidfile" .pid) running (pid $(cat "$pidfile"))"
      running=1
    else
      echo "$(basename "$pidfile" .pid) dead"
    fi
  done
  alive "$run/slurmctld.pid" && sinfo -N
  [ $running = 1 ]
}

# The RebootProgram: find which node's slurmd asked (our ancestor), then, detached from it, stop
# that slurmd and start it again in a new time namespace whose boot clock starts at zero. slurmctld
# then sees a boot time after its reboot request, as after a real reboot, and applies nextstate.
fake_reboot() {
  local pid=$PPID node="" pidfile
  shopt -s nullglob
  while [ -z "$node" ] && [ "$pid" -gt 1 ]; do
    for pidfile in "$run"/slurmd-*.pid; do
      [ "$(cat "$pidfile")" = "$pid" ] && node=$(basename "$pidfile" .pid) && node=${node#slurmd-}
    done
    [ -r "/proc/$pid/stat" ] || break
    pid=$(cut -d' ' -f4 "/proc/$pid/stat")
  done
  [ -n "$node" ] || { echo "fake-reboot: no slurmd among my ancestors" >&2; exit 1; }
  echo "$(date +%s) $node" >>"$log/reboots.log"
  setsid "$self" boot-node "$node" </dev/null >>"$log/reboots.log" 2>&1 &
}

boot_node() {
  local node=$1 pidfile=$run/slurmd-$1.pid offset uptime
  stop_pids "$pidfile"
  # Down for a moment, and then a boot clock near zero: slurmd reports a boot time no earlier than
  # slurmctld's reboot request, which is what tells slurmctld the reboot happened. Offsets are from
  # the host's clock, and we may run inside an earlier fake boot's namespace.
  sleep 1
  offset=$(awk '$1 == "boottime" { print $2 }' /proc/self/timens_offsets)
  uptime=$(($(cut -d. -f1 /proc/uptime) - ${offset:-0}))
  unshare --time --boottime "-$uptime" slurmd -f "$conf" -N "$node"
}

case "${1:-}" in
  start) start ;;
  # internal: the RebootProgram, and what it runs detached
  fake-reboot) fake_reboot ;;
  boot-node) boot_node "$2" ;;
  stop) stop ;;
  status) status ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
