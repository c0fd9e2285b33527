"""Containment first: the process that opens an incident drains the node before its flow run starts.

A flow run costs about half a second before its first node action on the warm path, and seconds
on the scaled-out one (a trigger, a worker, a fresh flow process); meanwhile the scheduler keeps
placing jobs on the faulty node. So the process that opened the incident decides on it once, as
triage does (`evaluate`: the same engine, facts and guardrails, the decision recorded), and when
the answer takes the node out of service (a drain, a GPU reset, a reboot, a replacement) without
waiting for a human's approval, it drains the node itself: under the one guardrail slot, with the
guardrails checked again there for the action the drain precedes, recorded as a `contain` stage
and a drain action, exactly as the flow's own drain would be.

The flow run then finds the node drained for its incident and carries out the rest. Everything
else (a diagnostic ladder, an escalation, an approval, a switch-wide incident) waits for the flow
as before. Should the flow end up deciding to leave the node alone (later evidence changed the
answer), `release` returns the node the containment took out.
"""

from __future__ import annotations

import uuid

from medic.incidents import Scope
from medic.policy import Action, Decision, Mode
from medic.policy.model import DESTRUCTIVE
from medic.statuses import StepStatus
from medic.store.metrics import CONTAIN_STAGE
from medic.tasks.nodes.evidence import evaluate
from medic.tasks.nodes.service import drain_incident, resume_node, take_out_of_service
from medic.tasks.runtime.process import Runtime
from medic.tasks.runtime.stage import stage

CONTAINED = DESTRUCTIVE | {Action.DRAIN}
STAGE = CONTAIN_STAGE  # its delays are /metrics' medic_contain_seconds (medic/store/metrics.py)
# The slot's lease names a holder; a containment has no flow run yet, so it holds the slot under
# an id derived from its incident (the same on every replica, which changes nothing: one slot).
_HOLDERS = uuid.UUID("6f1d9a52-3c8e-4f0b-9d47-2b8e1c5a7d31")


def contain(rt: Runtime, incident_id: str, node: str, scope: Scope) -> Decision | None:
    """Drain the incident's node now when its decision will take the node out; returns the
    decision it drained for, or None when it left the node to the flow run."""
    if scope != "node":
        return None  # a switch-wide incident is never acted on node by node
    decision = evaluate(rt, incident_id)
    if decision.action not in CONTAINED or decision.approve or decision.mode is Mode.OBSERVE:
        return None
    with stage(
        rt.store, incident_id, STAGE, node=node, why=f"{decision.action.value} by rule {decision.rule}"
    ) as step:
        taken = take_out_of_service(
            rt, incident_id, node, decision, decision.action.value, holder=uuid.uuid5(_HOLDERS, incident_id)
        )
        step.done(
            taken.detail,
            status=StepStatus.SKIPPED if taken.stopped else StepStatus.OK,
            guardrail=taken.guardrail,
        )
    return None if taken.stopped else decision


def release(rt: Runtime, incident_id: str, node: str) -> str | None:
    """Return the node when this incident's containment drained it and still holds it, but its
    flow decided to leave the node alone; None when there was no such drain to undo."""
    # The store first, one query: most incidents left alone were never contained, and for them the
    # scheduler (an `scontrol` call on Slurm) is not asked. A drain by another of the incident's
    # stages (a diagnostic's) answers for itself.
    if not any(s.stage == STAGE and s.status == StepStatus.OK for s in rt.store.steps_of(incident_id)):
        return None
    if drain_incident(rt.backends.scheduler.node(node).reason) != incident_id:
        return None  # no longer ours to return: resumed, or taken by someone since
    return resume_node(rt, incident_id, node)
