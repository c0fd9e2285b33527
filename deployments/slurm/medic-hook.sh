#!/bin/sh
# Runs `python -m apps.hooks PHASE` (prolog | epilog | healthcheck) for Slurm (docs/agent.md).
#
# Slurm starts Prolog, Epilog and HealthCheckProgram with almost no environment: no PATH and
# none of the site's variables. So PATH is set here, and the site's settings come from a file:
# medic-hooks.env beside this script, else /etc/default/medic-hooks (shell syntax, KEY=value):
#   MEDIC_PYTHON            the Python that has GPU Medic installed
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
# the node, and a missing Python is no reason to take GPUs out of service.
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

python=${MEDIC_PYTHON:-}
if [ -z "$python" ]; then
  # An installation under /opt, a checkout this script belongs to, or the system's Python.
  for candidate in /opt/gpu-medic/.venv/bin/python "$here/../../.venv/bin/python" python3; do
    if command -v "$candidate" >/dev/null 2>&1; then
      python=$candidate
      break
    fi
  done
fi
if [ -z "$python" ] || ! command -v "$python" >/dev/null 2>&1; then
  echo "medic $phase hook: no Python at '${python:-}'; set MEDIC_PYTHON in $here/medic-hooks.env" >&2
  exit 0
fi
"$python" -m apps.hooks "$phase"
status=$?
# 10 is apps.hooks' "the preflight failed and the prolog fails closed"; any other failure is
# the hook's own (GPU Medic not installed for this Python, a crash) and must not drain the node.
case $status in
  0) exit 0 ;;
  10) exit 1 ;;
  *)
    echo "medic $phase hook: $python -m apps.hooks exited $status; not failing the $phase" >&2
    exit 0
    ;;
esac
