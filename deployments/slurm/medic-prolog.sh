#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/medic-prolog.sh): DCGM level 1 before each job.
# Install it beside medic-hook.sh; settings: see medic-hook.sh.
exec "${0%/*}/medic-hook.sh" prolog
