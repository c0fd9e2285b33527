#!/usr/bin/env bash
# One command on a fresh machine: install what the tests need, then run the whole suite
# (unit, Prefect flows, PostgreSQL, Slurm, a real Prefect server) after the linters (docs/testing.md).
# Extra arguments go to pytest, e.g. scripts/test.sh -k flow
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh test

# PostgreSQL: the store and Prefect-server tests use a real one at 127.0.0.1:5432
# (point MEDIC_TEST_POSTGRES at another server to use that instead).
if [ -z "${MEDIC_TEST_POSTGRES:-}" ] && ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql
  fi
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 1 50); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 0.2; done
  pg_isready -h 127.0.0.1 -p 5432 || { echo "PostgreSQL is not reachable at 127.0.0.1:5432" >&2; exit 1; }
fi

# Slurm: the scheduler tests start a real local cluster from Debian's packages.
scripts/install-slurm.sh
# gcc: the NVML tests build a stand-in libnvidia-ml.so.1 that nvidia-ml-py loads for real.
if ! command -v gcc >/dev/null 2>&1; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc libc6-dev
fi

# Chromium: the Prefect UI test opens a flow run's page in it, headless (playwright drives it).
if ! command -v chromium >/dev/null 2>&1; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
fi

# Prometheus and Alertmanager: promtool checks and unit-tests the shipped alert rules
# (deployments/prometheus/), and the alert path runs through real ones.
if ! command -v promtool >/dev/null 2>&1; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus prometheus-alertmanager
fi

export PREFECT_SERVER_ANALYTICS_ENABLED=false
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports --no-cache  # the layers (pyproject.toml, docs/architecture.md)
.venv/bin/mypy  # every module of the medic package, every layer ([tool.mypy] in pyproject.toml)
# Two workers, each taking whole files (a file's fixtures, its Slurm cluster or Prefect server, stay
# in one process): most of the suite's time is system tests waiting on their services, so the two
# halve it on two cores (MEDIC_TEST_WORKERS=0 runs it in this process).
exec .venv/bin/pytest -n "${MEDIC_TEST_WORKERS:-2}" --dist loadfile "$@"
