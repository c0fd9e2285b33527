"""The spare pool on Slurm (`SparePool` in medic/protocols.py; docs/spares.md): the nodes of one
reservation, `medic-spares`, open to the user GPU Medic runs as and to no job.

Lending a spare takes it out of the reservation, so the next pending job (the one just requeued off a
node that must go) can start on it. Refilling adds a node to it, creating it for the first. Slurm keeps
the pool: it survives our restarts, and an admin sees it with `scontrol show reservation`. No other
reservation is ever changed here.
"""

from __future__ import annotations

import getpass
import logging

from medic.integrations.slurm.cli import SlurmCli
from medic.protocols import SPARES_RESERVATION

log = logging.getLogger(__name__)


class SlurmSpares:
    cli: SlurmCli

    def spare_nodes(self) -> frozenset[str]:
        return frozenset(self.cli.reservations().get(SPARES_RESERVATION, ()))

    def lend(self) -> str | None:
        pool = sorted(self.spare_nodes())
        if not pool:
            return None
        lent, rest = pool[0], pool[1:]
        if rest:
            self.cli.scontrol("update", f"ReservationName={SPARES_RESERVATION}", f"Nodes={','.join(rest)}")
        else:  # a reservation holds at least one node
            self.cli.scontrol("delete", f"ReservationName={SPARES_RESERVATION}")
        log.info("lent spare %s; %d left in %s", lent, len(rest), SPARES_RESERVATION)
        return lent

    def refill(self, node: str) -> None:
        pool = self.spare_nodes()
        if node in pool:
            return
        if pool:
            nodes = ",".join(sorted(pool | {node}))
            self.cli.scontrol("update", f"ReservationName={SPARES_RESERVATION}", f"Nodes={nodes}")
        else:
            self.cli.scontrol(
                "create",
                "reservation",
                f"ReservationName={SPARES_RESERVATION}",
                "StartTime=now",
                "Duration=infinite",
                f"Nodes={node}",
                f"Users={getpass.getuser()}",
            )
        log.info("%s refilled the spare pool %s", node, SPARES_RESERVATION)
