"""Guardrails: limits on what remediation may do to the fleet, whatever the rules say.

Pure like the engine: the decision and a snapshot of the fleet go in, the decision comes out,
turned into `escalate` (naming the guardrail) when a limit stops it. The flows build the
snapshot from the scheduler and the store; `medic triage` builds it from the decisions it has
made so far in the same file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from fnmatch import fnmatchcase
from typing import Protocol

from medic.incidents import Scope
from medic.policy.model import DESTRUCTIVE, OUT_OF_SERVICE, Action, Decision, Guardrails

HOUR = timedelta(hours=1)
# Actions no guardrail ever stops: they touch no node.
UNGUARDED = frozenset({Action.NONE, Action.ESCALATE})


@dataclass(frozen=True, slots=True)
class FleetState:
    now: datetime
    fleet_size: int | None = None  # unknown: only the count limits apply
    out_of_service: AbstractSet[str] = frozenset()  # nodes counted toward max_out_of_service right now
    destructive_at: tuple[datetime, ...] = ()  # our destructive actions, any node
    last_destructive: Mapping[str, datetime] = field(default_factory=dict)  # per node
    taken_out_at: Mapping[str, datetime] = field(default_factory=dict)  # latest time each node went out
    breaker_open: bool = False  # opened earlier; stays open until a human closes it


class Acting(Protocol):
    """What a decision asks for and the guardrail that stopped it: a `Decision`, or a replay's outcome
    (medic/whatif/replay_report.py)."""

    @property
    def action(self) -> Action: ...

    @property
    def diagnose_level(self) -> int | None: ...

    @property
    def guardrail(self) -> str | None: ...


def takes_node_out(decision: Acting) -> bool:
    if decision.action is Action.DIAGNOSE:
        # Levels 2-4 need the GPUs idle, so the node is drained for them.
        return (decision.diagnose_level or 1) >= 2
    return decision.action in OUT_OF_SERVICE


def _limit(count: int | None, percent: float | None, fleet_size: int | None) -> int | None:
    limits = [count] if count is not None else []
    if percent is not None and fleet_size:
        limits.append(max(1, math.ceil(fleet_size * percent / 100)))
    return min(limits) if limits else None


def breaker_trips(guardrails: Guardrails, state: FleetState, node: str) -> str | None:
    """Why taking `node` out now would be a storm (the breaker opens), or None."""
    breaker = guardrails.circuit_breaker
    if breaker is None:
        return None
    start = state.now - timedelta(minutes=breaker.window_minutes)
    # Nodes taken out within the window count even if they are back: a storm is the rate.
    recent = {n for n, at in state.taken_out_at.items() if at >= start} | {node}
    limit = _limit(breaker.nodes_at_least, breaker.nodes_percent, state.fleet_size)
    if limit is None or len(recent) <= limit:
        return None
    return f"{len(recent)} nodes taken out within {breaker.window_minutes} min (limit {limit})"


def check(
    guardrails: Guardrails, state: FleetState, node: str, decision: Acting, scope: Scope = "node"
) -> tuple[str, str] | None:
    """The first guardrail the decision would break, as (name, why); None when all hold.

    Built in, before the policy's own: an incident about a whole switch is never acted on node
    by node, whatever a rule says (the trouble is the network's, not any one node's)."""
    out = takes_node_out(decision)
    if decision.action in UNGUARDED:
        return None
    if scope == "switch":
        return "switch_incident", f"{node} is a switch: no node action on a switch-wide incident"
    touched = out or decision.action is Action.REINTEGRATE
    if touched and any(fnmatchcase(node, pattern) for pattern in guardrails.never_touch):
        return "never_touch", f"{node} is on the never-touch list"
    if not out:
        return None  # returning a healthy node is never held back, not even by an open breaker
    if state.breaker_open:
        return "circuit_breaker", "the circuit breaker is open; a human must close it"
    tripped = breaker_trips(guardrails, state, node)
    if tripped:
        return "circuit_breaker", tripped
    limit = _limit(guardrails.max_out_of_service, guardrails.max_out_of_service_percent, state.fleet_size)
    if limit is not None and node not in state.out_of_service and len(state.out_of_service) + 1 > limit:
        return (
            "max_out_of_service",
            f"{len(state.out_of_service)} nodes already out of service (limit {limit})",
        )
    if decision.action in DESTRUCTIVE:
        per_hour = guardrails.max_destructive_per_hour
        recent = sum(1 for at in state.destructive_at if state.now - at <= HOUR)
        if per_hour is not None and recent >= per_hour:
            return (
                "max_destructive_per_hour",
                f"{recent} destructive actions in the last hour (limit {per_hour})",
            )
        cooldown = guardrails.node_cooldown_minutes
        last = state.last_destructive.get(node)
        if cooldown and last is not None and state.now - last < timedelta(minutes=cooldown):
            minutes = (state.now - last).total_seconds() / 60
            return "node_cooldown", f"{node} was acted on {minutes:.0f} min ago (cooldown {cooldown} min)"
    return None


def apply(
    guardrails: Guardrails, state: FleetState, node: str, decision: Decision, scope: Scope = "node"
) -> Decision:
    stopped = check(guardrails, state, node, decision, scope)
    return decision if stopped is None else stop(decision, stopped)


def stop(decision: Decision, stopped: tuple[str, str]) -> Decision:
    """The decision escalated instead, naming the guardrail that stopped it and why."""
    name, why = stopped
    return decision.model_copy(
        update={
            "action": Action.ESCALATE,
            "diagnose_level": None,
            "guardrail": name,
            "blocked_action": decision.action,
            "reason": f"{decision.reason}; {decision.action.value} stopped by guardrail {name}: {why}",
        }
    )
