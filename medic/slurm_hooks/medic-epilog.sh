#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/medic-epilog.sh): DCGM level 2 after a job that failed.
# Install it beside medic-hook.sh; settings: see medic-hook.sh.
exec "${0%/*}/medic-hook.sh" epilog
