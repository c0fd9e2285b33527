"""Act: carry out the decided node action, at most once per fault."""

from __future__ import annotations

from prefect import task
from pydantic import BaseModel

from medic.policy import Action, Decision
from medic.policy.groups import observed
from medic.policy.model import DESTRUCTIVE
from medic.statuses import ACT_DONE_STATUSES, ActionStatus, ActStatus, StepStatus
from medic.store.tables import ActionRecord
from medic.tasks.nodes.contain import release
from medic.tasks.nodes.guard import guarded
from medic.tasks.nodes.host_evidence import keep_host_evidence
from medic.tasks.nodes.service import (
    ensure_drained,
    held_by_others,
    holding,
    reintegrate_node,
    take_out_of_service,
)
from medic.tasks.resume import JobsOff, move_jobs_off
from medic.tasks.runtime import prefect_events
from medic.tasks.runtime.process import Runtime, current
from medic.tasks.runtime.retry import transient_only
from medic.tasks.runtime.stage import stage


class ActOutcome(BaseModel):
    action: Action
    status: ActStatus
    detail: str
    done_by: str | None = None  # already done: the incident whose run carried the action out

    @property
    def took_node_out(self) -> bool:
        return self.status in ACT_DONE_STATUSES and self.action in DESTRUCTIVE | {Action.DRAIN}

    def verified_here(self, incident_id: str) -> bool:
        """Whether this run of `incident_id` verifies the node and brings it back: the action was
        carried out now, or by an earlier run of the same incident that ended before it could (a
        crash, a replica killed), which nobody else will finish. Another incident's action is
        that incident's run to verify."""
        if self.status == ActStatus.ALREADY_DONE:
            return self.done_by == incident_id
        return self.status == ActStatus.DONE


def _stopped(
    rt: Runtime, incident_id: str, node: str, action: Action, stopped: tuple[str, str]
) -> ActOutcome:
    name, why = stopped
    return ActOutcome(
        action=action,
        status=ActStatus.ESCALATED,
        detail=f"stopped by guardrail {name} at the last check: {why}; {holding(rt, incident_id, node)}",
    )


def _destructive(rt: Runtime, incident_id: str, node: str, gpu: int | None, decision: Decision) -> ActOutcome:
    action = decision.action
    key = f"{incident_id}:{node}:{action.value}"
    row = rt.store.get_action(key)
    if row is not None and row.status != ActionStatus.FAILED:  # a failed call is tried again below
        return _claimed_before(action, node, row)
    covering = _covering(rt, incident_id, node)
    if covering is not None:
        return _claimed_before(action, node, covering)
    holder = held_by_others(rt, node)
    if holder:
        return ActOutcome(action=action, status=ActStatus.ESCALATED, detail=f"{holder}; not touched")
    with guarded(rt, node, decision) as stopped:
        if stopped:
            return _stopped(rt, incident_id, node, action, stopped)
        row, claimed = rt.store.claim_action(key, incident_id, node, action.value)
        if not claimed:  # another run for this fault got there between our look and our claim
            return _claimed_before(action, node, row)
        return _call_provider(rt, incident_id, node, gpu, action, key)


def _covering(rt: Runtime, incident_id: str, node: str) -> ActionRecord | None:
    """Another incident's destructive action on the node that followed all of this one's evidence
    (a late duplicate, a second replica's incident, one opened after a restart): the fault is the
    same episode, and its action is that one (docs/decisions/0009)."""
    record = rt.store.get_incident(incident_id)
    if record is None:
        return None
    kinds = [a.value for a in DESTRUCTIVE]
    return rt.store.covering_action(node, record.last_event_at, kinds, other_than=incident_id)


def _claimed_before(action: Action, node: str, row: ActionRecord) -> ActOutcome:
    """The fault's action was claimed already: never a second reboot or replacement for it."""
    if row.status == ActionStatus.SUCCEEDED:
        return ActOutcome(
            action=action,
            status=ActStatus.ALREADY_DONE,
            detail=f"{row.action} already done for this fault (incident {row.incident_id}): {row.detail}",
            done_by=row.incident_id,
        )
    # An earlier attempt died between intent and outcome (reconciliation could not tell whether
    # the node was hit), or another run is at it right now: repeating it blind is worse than asking.
    return ActOutcome(
        action=action,
        status=ActStatus.ESCALATED,
        detail=f"another {action.value} of {node} for this fault has not reported back ({row.status}); "
        "not repeating it blind",
    )


def _call_provider(
    rt: Runtime, incident_id: str, node: str, gpu: int | None, action: Action, key: str
) -> ActOutcome:
    # Inside `_destructive`'s `guarded`: the guardrails were checked for this action under the slot,
    # which is held once for the whole transition (drain, jobs off, call), never taken a second time.
    try:
        drained = ensure_drained(rt, incident_id, node, action.value)
        # The jobs leave first: a reboot that fails, or waits for the node to go idle (Slurm),
        # must not leave them running on a node we hold out of service.
        off = move_jobs_off(rt, incident_id, node)
        if off.stuck:
            return _not_called(rt, key, node, action, drained, off)
        # Drained and idle, the node still holds what the action wipes: keep it, within a bound,
        # never at the cost of the action (medic/tasks/nodes/host_evidence.py).
        kept = keep_host_evidence(rt, incident_id, node, action, key)
        done = _provider_call(rt, node, gpu, action)
    except Exception as error:
        rt.store.finish_action(key, ActionStatus.FAILED, f"{type(error).__name__}: {error}")
        raise
    rt.store.finish_action(key, ActionStatus.SUCCEEDED, done)
    return ActOutcome(
        action=action,
        status=ActStatus.DONE,
        detail="; ".join(p for p in (drained, off.detail, kept, done) if p),
    )


def _provider_call(rt: Runtime, node: str, gpu: int | None, action: Action) -> str:
    provider = rt.backends.provider
    if action is Action.RESET_GPU:
        return _reset_or_reboot(rt, node, gpu)
    if action is Action.REBOOT:
        return provider.reboot(node)
    return provider.replace(node)


def _reset_or_reboot(rt: Runtime, node: str, gpu: int | None) -> str:
    """The GPU reset in place where one is configured; a reboot when it is not, or when the reset could
    not be done or confirmed, saying why (docs/gpu-reset.md). The reboot is this action's fallback, not a
    second action: one intent covers both, so a crash between them is settled or escalated, never
    repeated blind (medic/tasks/nodes/reconcile.py)."""
    provider = rt.backends.provider
    resetter = rt.backends.gpu_reset
    if resetter is None:
        return provider.reset_gpu(node, gpu)
    outcome = resetter.reset(node, gpu)
    if outcome.done:
        return outcome.detail
    return f"GPU reset not done ({outcome.detail}); rebooting instead: {provider.reboot(node)}"


def _not_called(rt: Runtime, key: str, node: str, action: Action, drained: str, off: JobsOff) -> ActOutcome:
    """Fail closed: a job still runs on the node, so the action is not called; its claim is given back."""
    rt.store.finish_action(key, ActionStatus.FAILED, f"not called: {off.stuck}")
    return ActOutcome(
        action=action,
        status=ActStatus.ESCALATED,
        detail=f"{drained}; {off.stuck}; {action.value} not called, {node} held out of service",
    )


def _handed_over(rt: Runtime, incident_id: str, node: str, decision: Decision) -> str:
    blocked = decision.blocked_action.value if decision.blocked_action else "action"
    if decision.guardrail:
        why = f"{blocked} stopped by guardrail {decision.guardrail}"
    elif decision.blocked_action is Action.DIAGNOSE:
        # The ladder's other stop: drained, but a job could not be moved off (medic/flows/ladder.py).
        why = "diagnose not run: a job still runs on the node"
    else:
        return f"handed to humans; {holding(rt, incident_id, node)}"
    return f"handed to humans ({why}); {holding(rt, incident_id, node)}"


def would_have(decision: Decision, node: str) -> str:
    """What an observed node would have had done to it, for its owner and the rollout's record."""
    what = decision.action.value
    if decision.diagnose_level is not None:
        what += f" L{decision.diagnose_level}"
    group = f"group {decision.group}" if decision.group else "the policy"
    return (
        f"would have: {what} {node} (rule {decision.rule}); {group} in observe mode, nothing done to "
        f"{node}: it is yours to act on"
    )


@task(
    name="act",
    task_run_name="act: {decision.action.value} {node}",
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient_only,
    timeout_seconds=1800,
)
def act(incident_id: str, node: str, gpu: int | None, decision: Decision) -> ActOutcome:
    rt = current()
    with stage(
        rt.store, incident_id, f"act: {decision.action.value}", node=node, why=f"rule {decision.rule}"
    ) as log:
        action = decision.action
        if observed(decision):
            outcome = ActOutcome(action=action, status=ActStatus.OBSERVED, detail=would_have(decision, node))
        elif action in DESTRUCTIVE:
            outcome = _destructive(rt, incident_id, node, gpu, decision)
        elif action is Action.DRAIN:
            taken = take_out_of_service(rt, incident_id, node, decision, "drain")
            outcome = (
                _stopped(rt, incident_id, node, action, taken.stopped)
                if taken.stopped
                else ActOutcome(action=action, status=ActStatus.DONE, detail=taken.detail)
            )
        elif action is Action.REINTEGRATE:
            outcome = ActOutcome(
                action=action, status=ActStatus.DONE, detail=reintegrate_node(rt, incident_id, node)
            )
        elif action is Action.ESCALATE:
            outcome = ActOutcome(
                action=action,
                status=ActStatus.ESCALATED,
                detail=_handed_over(rt, incident_id, node, decision),
            )
        else:
            # Left alone, but the containment may have drained it for an answer that since changed.
            returned = release(rt, incident_id, node)
            outcome = ActOutcome(
                action=action, status=ActStatus.SKIPPED, detail=returned or f"{node} left alone"
            )
        untouched = outcome.status in (ActStatus.SKIPPED, ActStatus.OBSERVED)
        if not untouched:
            prefect_events.action_taken(incident_id, node, action.value, outcome.status, outcome.detail)
        log.done(
            outcome.detail,
            status=StepStatus.SKIPPED if untouched else StepStatus.OK,
            result=outcome.status,
        )
        return outcome
