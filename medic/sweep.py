"""Scheduled sweeps: which idle nodes to deep-check next, and why (docs/sweeps.md).

Pure: the scheduler's nodes, the fleet's ageing (medic/ageing.py), when each node last had a deep
DCGM run, the guardrails and the fleet's state in; a plan out. A node that is wearing out (incidents
again and again, error counters climbing) is checked first; among equals, the one checked longest ago.
A sweep holds each node it checks with a reservation, which takes the node out of the schedulable
pool as a drain does, so the plan counts its picks against the guardrails like drains.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from medic.ageing import FleetHealth, NodeHealth
from medic.errors import PermanentError
from medic.policy.guardrails import FleetState, check
from medic.policy.model import Action, Guardrails
from medic.protocols import NodeInfo, NodeState

SCHEMA_VERSION = 1
RESERVATION_PREFIX = "medic-sweep-"  # every reservation a sweep makes is named so, and only those
DIAGNOSTIC_PREFIX = "sweep: "  # the detail of each sweep's DCGM run in the store


class NodeBusyError(PermanentError):
    """Raised by `Reservations.reserve` when a node took a job between the plan and the reservation:
    the sweep skips that node, it is not a failure."""

    def __init__(self, node: str, detail: str) -> None:
        super().__init__(f"{node} is busy: {detail}")
        self.node = node


class SweepSettings(BaseModel):
    """What a sweep runs and how much of the fleet it may hold; the defaults are docs/sweeps.md's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    level: int = Field(2, ge=1, le=4, description="The DCGM level run on each node.")
    max_nodes: PositiveInt = Field(2, description="Nodes one sweep checks at most.")
    reservation_minutes: PositiveInt = Field(
        30, description="How long each node is held; never less than the level's time budget."
    )
    stale_after_hours: float = Field(
        168, gt=0, description="A node not deep-checked for this long is due (never checked: due)."
    )
    at_risk_after_hours: float = Field(
        24, gt=0, description="A node with any ageing evidence is due again this soon after its last check."
    )


@dataclass(frozen=True, slots=True)
class Reserving:
    """What the guardrails are asked about for each node: a reservation takes it out as a drain does."""

    action: Action = Action.DRAIN
    diagnose_level: int | None = None
    guardrail: str | None = None


class Pick(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str
    score: float  # its ageing score (medic/ageing.py); 0 without evidence
    last_check: datetime | None  # its last DCGM run at level 2 or more; None: never
    reasons: list[str]


class Skip(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str
    why: str


class SweepPlan(BaseModel):
    """`medic sweep plan --json` (docs/sweeps.md#json): a field is only ever added."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    at: datetime
    settings: SweepSettings
    picks: list[Pick]  # in the order they run, the riskiest first
    skipped: list[Skip]  # every other node, and why


def _ago(span: timedelta) -> str:
    hours = span / timedelta(hours=1)
    return f"{hours / 24:.1f} days" if hours >= 48 else f"{hours:.0f} h"


def _due(
    last: datetime | None, score: float, settings: SweepSettings, now: datetime
) -> tuple[str | None, str | None]:
    """(why the node is due, why it is not): one of the two is None."""
    if last is None:
        return "never deep-checked", None
    age = now - last
    stale = timedelta(hours=settings.stale_after_hours)
    if age >= stale:
        return f"last deep check {_ago(age)} ago (stale after {_ago(stale)})", None
    at_risk = timedelta(hours=settings.at_risk_after_hours)
    if score > 0 and age >= at_risk:
        return f"last deep check {_ago(age)} ago; at risk, due again after {_ago(at_risk)}", None
    return None, f"deep-checked {_ago(age)} ago"


def _risk(health: NodeHealth | None) -> list[str]:
    if health is None:
        return []
    worst = health.gpus[0]
    where = "the node" if worst.gpu is None else f"GPU {worst.gpu}"
    return [f"ageing score {health.score:g} (rank {health.rank}, worst: {where})"] + [
        e.why for e in worst.evidence
    ]


def _unavailable(node: NodeInfo, reserved: frozenset[str]) -> str | None:
    if node.name in reserved:
        return "held by a sweep's reservation"
    if node.state is NodeState.IDLE:
        return None
    if node.out_of_service:
        return f"{node.state.value}: already out of service" + (f" ({node.reason})" if node.reason else "")
    return f"{node.state.value}: not idle, a job may run on it"


def plan(
    nodes: Sequence[NodeInfo],
    health: FleetHealth,
    last_checks: Mapping[str, datetime],
    guardrails: Guardrails,
    state: FleetState,
    settings: SweepSettings,
    reserved: frozenset[str] = frozenset(),
) -> SweepPlan:
    """The nodes a sweep would check now, the riskiest first, and why every other node is left.

    Only idle nodes, as the scheduler shows them, are candidates. Each pick is counted out of service
    for the picks after it, so the plan never holds more than `max_out_of_service` or the breaker
    allows, with the nodes already out (`state`, which counts `reserved` too)."""
    now = state.now
    by_node = {n.node: n for n in health.nodes}
    skipped: list[Skip] = []
    due: list[tuple[tuple[float, float, str], Pick]] = []
    for node in nodes:
        why_not = _unavailable(node, reserved)
        score = by_node[node.name].score if node.name in by_node else 0.0
        last = last_checks.get(node.name)
        why, not_due = _due(last, score, settings, now)
        if why_not or not_due:
            skipped.append(Skip(node=node.name, why=why_not or not_due or ""))
            continue
        assert why is not None
        staleness = float("inf") if last is None else (now - last).total_seconds()
        pick = Pick(
            node=node.name, score=score, last_check=last, reasons=[*_risk(by_node.get(node.name)), why]
        )
        due.append(((-score, -staleness, node.name), pick))
    picks: list[Pick] = []
    for _, pick in sorted(due, key=lambda d: d[0]):
        if len(picks) >= settings.max_nodes:
            skipped.append(
                Skip(node=pick.node, why=f"due, but this sweep checks {settings.max_nodes} at most")
            )
            continue
        stopped = check(guardrails, state, pick.node, Reserving())
        if stopped is not None:
            skipped.append(Skip(node=pick.node, why=f"due, but guardrail {stopped[0]}: {stopped[1]}"))
            continue
        picks.append(pick)
        state = replace(
            state,
            out_of_service=state.out_of_service | {pick.node},
            taken_out_at={**state.taken_out_at, pick.node: now},
        )
    return SweepPlan(at=now, settings=settings, picks=picks, skipped=sorted(skipped, key=lambda s: s.node))
