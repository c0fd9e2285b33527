"""The nodes GPU Medic holds out of service, and what the scheduler says of each.

A node we drained (a containment, a diagnostic, an action that must be verified first) stays ours
until our own `resume` returns it: an incident handed to people leaves it drained for them, never
returned in silence. The store knows which nodes those are; only the scheduler knows whether someone
returned one by hand since (`medic node held`, /metrics, `medic report`).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel

from medic.protocols import NodeInfo


class Hold(BaseModel):
    """A node whose last successful action of ours took it out of service, with no `resume` of ours since."""

    node: str
    incident: str  # the incident whose action holds it
    action: str  # that action: drain, reset_gpu, reboot, replace
    since: datetime  # when it finished
    incident_status: str | None = None  # None: the incident is not in this store (pruned)
    outcome: str | None = None  # the incident's outcome, when it ended: why we hold the node


class InScheduler(StrEnum):
    """How the scheduler shows a held node."""

    HELD = "held"  # drained (down) with our reason for this incident
    OURS_OTHER = "held for another incident"  # our reason, naming another incident
    RETURNED = "returned by someone else"  # in service again, not by us
    TAKEN = "taken by someone else"  # drained or down with someone else's reason
    UNKNOWN = "unknown"  # the scheduler did not answer, or does not know the node


def in_scheduler(hold: Hold, info: NodeInfo | None, drained_for: str | None) -> InScheduler:
    """What the scheduler says of a held node (`drained_for`: the incident its drain reason names)."""
    if info is None:
        return InScheduler.UNKNOWN
    if info.drained_by_medic:
        return InScheduler.HELD if drained_for == hold.incident else InScheduler.OURS_OTHER
    return InScheduler.TAKEN if info.out_of_service else InScheduler.RETURNED
