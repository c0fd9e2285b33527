"""Settling an action whose outcome a crash lost, from a boot record (medic/tasks/nodes/reconcile.py).

A boot after the intent proves the node went down since: the reboot, reset or replacement took effect.
An earlier boot proves nothing by itself (a cloud reboot may still be on its way): only a provider that
also knows its request never arrived may call that "not done" (`not_booted`).
"""

from __future__ import annotations

from datetime import datetime

from medic.protocols import BootClock, Settled


def booted_since(node: str, booted: datetime | None, since: datetime) -> Settled | None:
    """Done when the node booted at or after `since`; None otherwise (no proof either way)."""
    if booted is None or booted < since:
        return None
    return Settled(True, f"{node} booted at {booted:%Y-%m-%d %H:%M:%S%z}, after the intent")


def not_booted(node: str, booted: datetime) -> Settled:
    return Settled(False, f"{node} has not booted since the intent (last boot {booted:%Y-%m-%d %H:%M:%S%z})")


def witnessed(witness: object, node: str, since: datetime) -> Settled | None:
    """The scheduler's boot record (Slurm's BootTime as slurmd registered it) where the provider has
    none: a cloud API that keeps an instance `running` through a reboot cannot tell one happened."""
    if not isinstance(witness, BootClock):
        return None
    return booted_since(node, witness.booted_at(node), since)
