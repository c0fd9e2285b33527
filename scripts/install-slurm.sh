#!/usr/bin/env bash
# Install the Debian Slurm packages the Slurm tests run a real cluster with (scripts/slurm-cluster.sh).
# Idempotent: does nothing when slurmctld is already on PATH. Needs root; starts no daemon.
set -euo pipefail
if command -v slurmctld >/dev/null 2>&1; then
  exit 0
fi
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  slurmctld slurmd slurm-client munge
