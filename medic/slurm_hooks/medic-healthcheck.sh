#!/bin/sh
# Slurm HealthCheckProgram (slurm.conf: HealthCheckProgram=/etc/slurm/medic-healthcheck.sh): DCGM level 1.
# Install it beside medic-hook.sh; settings: see medic-hook.sh.
exec "${0%/*}/medic-hook.sh" healthcheck
