"""Scheduler operations on a node that every stage shares, each recorded as an action.

Taking a node out of service is one transition, wherever it is asked for: `take_out_of_service`
checks the guardrails again under the `medic-node-actions` slot (`tasks/guard.py`) and drains only
if they hold. `ensure_drained` refuses to run outside that slot (docs/decisions/0007).
"""

from __future__ import annotations

from dataclasses import dataclass

from medic.errors import PermanentError
from medic.policy import Decision
from medic.protocols import NodeInfo, NodeState
from medic.statuses import ActionStatus
from tasks.guard import guarded, inside_guarded
from tasks.runtime import Runtime


class OutsideGuardrailSlotError(PermanentError, RuntimeError):
    """Raised when a node would be drained outside `guarded`: past the guardrails, a programming error."""


@dataclass(frozen=True, slots=True)
class OutOfService:
    """What `take_out_of_service` did: drained (or found out already), or stopped by a guardrail."""

    detail: str
    stopped: tuple[str, str] | None = None  # (guardrail, why) when it said no

    @property
    def guardrail(self) -> str | None:
        return self.stopped[0] if self.stopped else None


def take_out_of_service(rt: Runtime, incident_id: str, node: str, intent: Decision, why: str) -> OutOfService:
    """The one way a node is drained: the guardrails checked again under the slot for `intent` (a
    `drain`, a `diagnose` at level 2 or more, ...), a tripped breaker recorded, and only then the drain.
    Stopped, the node is left as it is, and the caller escalates with the guardrail's name."""
    with guarded(rt, node, intent) as stopped:
        if stopped:
            name, reason = stopped
            return OutOfService(
                detail=f"{node} not drained: stopped by guardrail {name} at the last check: {reason}",
                stopped=stopped,
            )
        return OutOfService(detail=ensure_drained(rt, incident_id, node, why))


def drain_reason(incident_id: str, why: str) -> str:
    # The "medic:" prefix marks drains as ours: we only ever resume nodes whose reason has it.
    return f"medic: {why} incident {incident_id}"


def held_by_others(rt: Runtime, node: str) -> str | None:
    """Who else holds the node out of service (an admin, a health check, another tool), or None.

    Such a node is never rebooted, replaced or reset by us: whoever took it out may be working on
    it, and a node Slurm marked down without answering needs someone at its console."""
    return _holder(rt.backends.scheduler.node(node))


def _holder(info: NodeInfo) -> str | None:
    if info.drained_by_medic or info.state not in (NodeState.DRAINED, NodeState.DOWN):
        return None
    return f"{info.name} is {info.state.value} by others ({info.reason or 'no reason given'})"


def ensure_drained(rt: Runtime, incident_id: str, node: str, why: str) -> str:
    """Drain the node for this incident unless it is already out of service. Returns what happened.

    Only inside `guarded` (the slot held, the guardrails just checked): call `take_out_of_service`."""
    if not inside_guarded():
        raise OutsideGuardrailSlotError(f"{node} would be drained ({why}) outside the guardrail slot")
    info = rt.backends.scheduler.node(node)
    if info.drained_by_medic:
        return f"{node} already drained by medic"
    holder = _holder(info)
    if holder:  # leave their reason alone
        return f"{holder}; left as is"
    key = f"{incident_id}:{node}:drain"
    _, fresh = rt.store.claim_action(key, incident_id, node, "drain")
    try:
        rt.backends.scheduler.drain(node, drain_reason(incident_id, why))
    except Exception as error:
        rt.store.finish_action(key, ActionStatus.FAILED, f"{type(error).__name__}: {error}")
        raise
    rt.store.finish_action(key, ActionStatus.SUCCEEDED, f"drained {node}", attempts=1 if fresh else 0)
    return f"drained {node}"


def resume_node(rt: Runtime, incident_id: str, node: str) -> str:
    """Return a node to service, but only one that we drained."""
    info = rt.backends.scheduler.node(node)
    if not info.drained_by_medic:
        return f"{node} not resumed: it is {info.state.value} ({info.reason or 'no reason'}), not drained by medic"
    key = f"{incident_id}:{node}:resume"
    rt.store.claim_action(key, incident_id, node, "resume")
    rt.backends.scheduler.resume(node)
    rt.store.finish_action(key, ActionStatus.SUCCEEDED, f"resumed {node}")
    return f"resumed {node}"
