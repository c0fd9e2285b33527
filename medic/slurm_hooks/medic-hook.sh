#!/bin/sh
# Runs GPU Medic's installed `medic-slurm-hook PHASE` (prolog | epilog | healthcheck) for Slurm
# (docs/agent.md). `medic node install-hooks /etc/slurm` writes these scripts from the installed package.
#
# Slurm starts Prolog, Epilog and HealthCheckProgram with almost no environment: no PATH and
# none of the site's variables. So PATH is set here, and the site's settings come from a file:
# medic-hooks.env beside this script, else /etc/default/medic-hooks (shell syntax, KEY=value):
#   MEDIC_BIN               the folder of GPU Medic's commands (the virtualenv's bin/ that
#                           `pip install 'gpu-medic[node]'` filled); default /opt/gpu-medic/bin,
#                           then PATH
#   MEDIC_URL, MEDIC_TOKEN  where events go (or MEDIC_EVENTS_FILE for a JSON-lines file)
#   MEDIC_DCGMI             dcgmi's path when it is not on the standard PATH
#   MEDIC_HOOK_TIMEOUT_S    limit for one dcgmi run in the epilog and health check (default
#                           120 s at level 1, 600 s at level 2)
#   MEDIC_PROLOG_BUDGET_S   the prolog's whole preflight: quick checks, then DCGM level 1 (30 s)
#   MEDIC_EXPECTED_GPUS     GPUs this node should have (0: none, NVML may be absent); unset: not checked
#   MEDIC_PROLOG_FAIL_CLOSED=1  a failed preflight drains the node with our reason
#                               (`medic: preflight <check>: <detail>`) and fails the prolog, so
#                               Slurm requeues the job
#   SLURM_CONF              slurm.conf for that drain, when scontrol does not find it by itself
# Keep the file root-only (chmod 600): it holds the token.
#
# Anything that keeps the hook itself from running exits 0: a non-zero Prolog or Epilog drains
# the node, and a missing or broken install is no reason to take GPUs out of service.
set -u
phase=${1:-}
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
here=$(CDPATH='' cd -- "$(dirname -- "$0")" && pwd)

for settings in "$here/medic-hooks.env" /etc/default/medic-hooks; do
  if [ -r "$settings" ]; then
    set -a
    # shellcheck source=/dev/null
    . "$settings"
    set +a
    break
  fi
done

bin=${MEDIC_BIN:-/opt/gpu-medic/bin}
hook=
if [ -x "$bin/medic-slurm-hook" ]; then
  hook=$bin/medic-slurm-hook
elif [ -z "${MEDIC_BIN:-}" ]; then  # no folder named: whatever the standard PATH has
  hook=$(command -v medic-slurm-hook 2>/dev/null || true)
fi
if [ -z "$hook" ]; then
  echo "medic $phase hook: no medic-slurm-hook in '${MEDIC_BIN:-/opt/gpu-medic/bin}' or on PATH; set MEDIC_BIN in $here/medic-hooks.env" >&2
  exit 0
fi
"$hook" "$phase"
status=$?
# 10 is the hook's "the preflight failed and the prolog fails closed"; any other failure is the
# hook's own (GPU Medic broken in that environment, a crash) and must not drain the node.
case $status in
  0) exit 0 ;;
  10) exit 1 ;;
  *)
    echo "medic $phase hook: $hook exited $status; not failing the $phase" >&2
    exit 0
    ;;
esac
