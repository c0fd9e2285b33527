#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/medic-prolog.sh): the preflight before each job,
# NVML's quick checks, then DCGM level 1, within MEDIC_PROLOG_BUDGET_S.
# Install it beside medic-hook.sh; settings: see medic-hook.sh.
exec "${0%/*}/medic-hook.sh" prolog
