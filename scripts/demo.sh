#!/usr/bin/env bash
# One command on a fresh machine: install GPU Medic and run the simulated end-to-end demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false
exec .venv/bin/medic demo "$@"
