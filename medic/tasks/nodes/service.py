"""Scheduler operations on a node that every stage shares, each recorded as an action.

Taking a node out of service is one transition, wherever it is asked for: `take_out_of_service`
checks the guardrails again under the `medic-node-actions` slot (`medic/tasks/nodes/guard.py`) and drains only
if they hold. `ensure_drained` refuses to run outside that slot (docs/decisions/0007).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from uuid import UUID

from medic.errors import PermanentError
from medic.policy import Action, Decision
from medic.policy.model import DESTRUCTIVE
from medic.protocols import NodeInfo, NodeState
from medic.statuses import ACTIVE_INCIDENT_STATUSES, ActionStatus, StepStatus
from medic.tasks.nodes.guard import guarded, inside_guarded
from medic.tasks.runtime.process import Runtime

# Every replacement or repair on record counts, however old: the node has not been checked since.
EVER = datetime(1970, 1, 1, tzinfo=UTC)
REPAIRS = frozenset(a.value for a in DESTRUCTIVE)


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


def take_out_of_service(
    rt: Runtime, incident_id: str, node: str, intent: Decision, why: str, holder: UUID | None = None
) -> OutOfService:
    """The one way a node is drained: the guardrails checked again under the slot for `intent` (a
    `drain`, a `diagnose` at level 2 or more, ...), a tripped breaker recorded, and only then the drain.
    Stopped, the node is left as it is, and the caller escalates with the guardrail's name.
    `holder` holds the slot outside a flow run (`guarded`)."""
    with guarded(rt, node, intent, holder) as stopped:
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


# Not anchored at the end: Slurm appends to the reason (" : reboot issued" after a reboot).
_DRAINED_FOR = re.compile(r" incident (\S+)")


def drain_incident(reason: str | None) -> str | None:
    """The incident a drain of ours was made for, read from its `drain_reason`; None if it names none."""
    named = _DRAINED_FOR.findall(reason or "")
    return named[-1] if named else None


def held_by_others(rt: Runtime, node: str) -> str | None:
    """Who else holds the node out of service (an admin, a health check, another tool), or None.

    Such a node is never rebooted, replaced or reset by us: whoever took it out may be working on
    it, and a node Slurm marked down without answering needs someone at its console."""
    return _holder(rt.backends.scheduler.node(node))


def _holder(info: NodeInfo) -> str | None:
    if info.drained_by_medic or info.state not in (NodeState.DRAINED, NodeState.DOWN):
        return None
    return f"{info.name} is {info.state.value} by others ({info.reason or 'no reason given'})"


def holding(rt: Runtime, incident_id: str, node: str, none: str = "node not touched") -> str:
    """What an escalation leaves people with, from the store's actions: the node this incident drained
    (its containment, a diagnostic) is held for them, out of service, never returned in silence; one
    another incident of ours holds says which; with no hold of ours on the node, `none`."""
    held = rt.store.held_nodes(node)
    if not held:
        return none
    (hold,) = held
    if hold.incident == incident_id:
        return (
            f"{node} {_TAKEN[hold.action]} by GPU Medic and held for you: out of service until a human "
            "resumes it in the scheduler or a later incident reintegrates it"
        )
    return f"node not touched by this incident; {node} is held by GPU Medic for incident {hold.incident}"


# How an action left the node, in a sentence about who holds it.
_TAKEN = {
    "drain": "drained",
    "reset_gpu": "drained (GPU reset)",
    "reboot": "drained (rebooted)",
    "replace": "drained (replaced)",
}


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
    """Return a node to service, but only one that we drained and no other incident still works on."""
    info = rt.backends.scheduler.node(node)
    if not info.drained_by_medic:
        return f"{node} not resumed: it is {info.state.value} ({info.reason or 'no reason'}), not drained by medic"
    holder = _held_by_another_incident(rt, incident_id, info)
    if holder:
        return f"{node} not resumed: {holder}"
    key = f"{incident_id}:{node}:resume"  # what `returned` reads
    rt.store.claim_action(key, incident_id, node, "resume")
    rt.backends.scheduler.resume(node)
    rt.store.finish_action(key, ActionStatus.SUCCEEDED, f"resumed {node}")
    return f"resumed {node}"


def returned(rt: Runtime, incident_id: str, node: str) -> bool:
    """Whether this incident has returned the node to service (`resume_node` succeeded)."""
    row = rt.store.get_action(f"{incident_id}:{node}:resume")
    return row is not None and row.status == ActionStatus.SUCCEEDED


def reintegrate_node(rt: Runtime, incident_id: str, node: str) -> str:
    """Return a node to service for a `reintegrate` decision, unless our last replacement or repair of
    it has not passed the deep checks the policy requires for that transition: a later passing
    diagnostic does not re-run an all-reduce, so it cannot stand in for them."""
    unverified = _unverified_repair(rt, node)
    if unverified:
        return f"{node} not resumed: {unverified}"
    return resume_node(rt, incident_id, node)


def _unverified_repair(rt: Runtime, node: str) -> str | None:
    repairs = [a for a in rt.store.node_actions(node, EVER) if a.action in REPAIRS]
    if not repairs:
        return None
    last = repairs[-1]
    required = rt.policy().policy.deep_checks.required(replaced=last.action == Action.REPLACE)
    if not required:
        return None
    detail = rt.store.incident_detail(last.incident_id)
    done_at = last.finished_at or last.intent_at
    steps = detail.steps if detail is not None else []
    if any(
        s.stage.startswith("verify") and s.status == StepStatus.OK and s.finished_at >= done_at for s in steps
    ):
        return None
    return (
        f"its {last.action} in incident {last.incident_id} has not passed the deep checks the policy requires "
        f"({', '.join(required)}); a human returns it"
    )


def _held_by_another_incident(rt: Runtime, incident_id: str, info: NodeInfo) -> str | None:
    """Which other incident of ours the drain still serves, or None when it is this one's, a past one's
    (closed, escalated, failed: a node we took out, however long ago, comes back once it passes) or
    names none (a hand-written "medic:" reason)."""
    owner = drain_incident(info.reason)
    if owner is None or owner == incident_id:
        return None
    record = rt.store.get_incident(owner)
    if record is None:
        # Fail closed: another deployment's store, or a pruned one, may still be testing the node.
        return f"drained for incident {owner}, which this store does not know; left to whoever holds it"
    if record.status in ACTIVE_INCIDENT_STATUSES:
        return f"drained for incident {owner}, which is still {record.status}; that incident returns it"
    return None
