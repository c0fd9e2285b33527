"""Slurm reservations for sweeps (`Reservations` in medic/protocols.py; docs/sweeps.md).

A MAINT reservation starting now holds idle nodes so that no job lands on them during a deep check.
It is made without IGNORE_JOBS: Slurm itself refuses a node that took a job since the plan, which is
the check we could not make race-free ourselves. Only reservations named `medic-sweep-*` are ever
listed or deleted here: an admin's are none of our business.
"""

from __future__ import annotations

import getpass
import logging
import uuid
from collections.abc import Sequence

from medic.integrations.slurm.cli import SlurmCli
from medic.integrations.slurm.errors import SlurmRejectedError
from medic.sweep import RESERVATION_PREFIX, NodeBusyError

log = logging.getLogger(__name__)

# What scontrol says (lower-cased) when a node of the reservation holds a job or another reservation.
BUSY = ("requested nodes are busy", "nodes are busy", "overlaps an existing reservation")
GONE = "requested reservation is invalid"  # delete of a reservation that no longer exists


class SlurmReservations:
    """Reservations through `scontrol` (`SlurmScheduler` has them). Only the user GPU Medic runs as
    may use the reserved nodes: the deep check's own `srun`, where DCGM is run that way."""

    cli: SlurmCli

    def reserve(self, nodes: Sequence[str], minutes: int, reason: str) -> str:
        if not nodes:
            raise ValueError("a reservation needs at least one node")
        name = f"{RESERVATION_PREFIX}{uuid.uuid4().hex[:12]}"
        try:
            self.cli.scontrol(
                "create",
                "reservation",
                f"ReservationName={name}",
                "StartTime=now",
                f"Duration={minutes}",
                f"Nodes={','.join(nodes)}",
                f"Users={getpass.getuser()}",
                "Flags=MAINT",
            )
        except SlurmRejectedError as error:
            if any(marker in error.detail.lower() for marker in BUSY):
                raise NodeBusyError(",".join(nodes), error.detail) from error
            raise
        log.info("reserved %s for %d min as %s: %s", ",".join(nodes), minutes, name, reason)
        return name

    def release(self, name: str) -> None:
        if not name.startswith(RESERVATION_PREFIX):
            raise ValueError(f"{name} is not a sweep's reservation: GPU Medic deletes only its own")
        try:
            self.cli.scontrol("delete", f"ReservationName={name}")
        except SlurmRejectedError as error:
            if GONE not in error.detail.lower():
                raise
            log.info("reservation %s was already gone (expired or deleted)", name)

    def reserved_nodes(self) -> frozenset[str]:
        held = self.cli.reservations()
        return frozenset(
            node for name, nodes in held.items() if name.startswith(RESERVATION_PREFIX) for node in nodes
        )
