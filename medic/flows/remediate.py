"""The remediation flow: one run per incident.

triage → diagnose (DCGM ladder, re-deciding after each level) → decide → act → resume job →
verify (and the deep checks the policy requires after a replacement or repair)/reintegrate → notify →
close. The node's jobs are moved off it before anything stresses or
resets it (a level 2-4 diagnostic, a destructive action), so `resume job` only waits on those
(docs/decisions/0008-job-off-node.md). Every stage writes to the store; the run is tagged with
node, job, owner, classification, action, mode and group, carries a markdown audit artifact and a link to
its record, its task runs are named for what they did ("act: reboot gpu-node-3"), and each stage
logs one line (what, on which node, why, how it ended: medic/tasks/runtime/stage.py), so the Prefect UI's run
history reads as an audit on its own (docs/serve.md). The node's group's mode bounds all of it
(docs/decisions/0017): in observe mode nothing is done past the decision but telling the owner what
would have been; in contain mode a repair waits for a human's approval, its node drained and emptied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_link_artifact, acreate_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from prefect.states import State
from prefect.utilities.urls import url_for
from pydantic import BaseModel

from medic.artifacts import Artifact, artifacts_of, step_artifacts
from medic.audit import incident_markdown
from medic.events import FaultEvent
from medic.facts import straggler_verdict
from medic.flows.approval import await_approval
from medic.flows.ladder import diagnose_ladder
from medic.hangs import hung_jobs
from medic.policy import Action, Decision, Mode
from medic.policy.groups import observed
from medic.policy.model import DESTRUCTIVE
from medic.protocols import Message
from medic.statuses import TERMINAL_INCIDENT_STATUSES, ActStatus, IncidentStatus
from medic.store import IncidentDetail
from medic.store.tables import DecisionRecord
from medic.tasks.act import ActOutcome, act
from medic.tasks.close import close
from medic.tasks.decide import decide_incident
from medic.tasks.nodes.guard import ensure_limits
from medic.tasks.nodes.spares import lend_spare
from medic.tasks.notify import IncidentThread
from medic.tasks.resume import ResumeOutcome, moved_jobs, restart_hung_job, resume_job
from medic.tasks.runtime.process import current
from medic.tasks.runtime.stage import stage
from medic.tasks.triage import Triage, triage
from medic.tasks.verify import VerifyOutcome, verify, verify_budget_s


class Outcome(BaseModel):
    incident: str
    node: str
    classification: str
    action: str
    rule: str
    reason: str
    act: str
    resumed: ResumeOutcome | None = None
    verified: VerifyOutcome | None = None
    diagnostics: list[str] = []
    notified: bool = False
    summary: str


def _run_name() -> str:
    params = flow_run.parameters
    return f"{params['incident_id']}-{params['node']}"


async def _tag_run(triaged: Triage, decision: Decision) -> None:
    run_id = flow_run.id
    if run_id is None:
        return
    tags = {
        "medic",
        f"node:{triaged.node}",
        f"classification:{decision.classification.value}",
        f"action:{decision.action.value}",
        f"rule:{decision.rule}",
        f"mode:{decision.mode.value}",
        *(f"job:{j}" for j in triaged.jobs),
    }
    if decision.group:
        tags.add(f"group:{decision.group}")
    if triaged.owner:
        tags.add(f"owner:{triaged.owner}")
    async with get_client() as client:
        await client.update_flow_run(run_id, tags=sorted(tags | set(flow_run.tags)))


def in_place(node: str, jobs: list[str]) -> str:
    """What happens to the jobs of a node that stays in service: no requeue, which would cost a fresh
    launch elsewhere; a crashed job restarts where it is (issue 37: 6.7 s in place against 14.3 s for
    a fresh launch, BENCHMARKS.md)."""
    which = f"job {jobs[0]}" if len(jobs) == 1 else f"jobs {', '.join(jobs)}"
    return (
        f"{which} not requeued: {node} stays in service, so a crash restarts in place from the last "
        "checkpoint (torchrun --max-restarts)"
    )


def summary_of(
    decision: Decision,
    acted: ActOutcome,
    resumed: ResumeOutcome | None,
    verified: VerifyOutcome | None,
    stayed: str | None,
) -> str:
    parts = [
        f"{decision.classification.value} fault → {decision.action.value} ({acted.status}: {acted.detail})"
    ]
    if stayed:
        parts.append(stayed)
    if resumed:
        parts.append(resumed.describe())
    if verified:
        parts.append(verified.detail)
    return "; ".join(parts)


def first_message(triaged: Triage, decision: Decision, evidence: list[FaultEvent]) -> Message:
    kinds = sorted({e.kind.value for e in evidence})
    summary = f"Evidence: {len(evidence)} events ({', '.join(kinds)})"
    body = f"{summary}\nDecision: rule `{decision.rule}` — {decision.reason}"
    verdict = straggler_verdict(evidence)
    if verdict is not None:
        body += f"\n{verdict.text()}"  # why the straggler is slow; its two traces are attached below
    problem = current().policy_problem
    if problem:
        # The owner of the policy must hear that their edit did not take effect.
        body += f"\nWarning: {problem}"
    return Message(
        incident=triaged.incident,
        channel=triaged.channel,
        title=f"{decision.classification.value.capitalize()} fault on {triaged.subject}: {_what(decision)}",
        body=body,
        recommend=tuple(decision.recommend),
        fields={
            "node": ", ".join(triaged.nodes),
            "gpu": "" if triaged.gpu is None else str(triaged.gpu),
            "jobs": ", ".join(triaged.jobs),
            "owner": triaged.owner or "",
            "mode": decision.mode.value + (f" (group {decision.group})" if decision.group else ""),
            "flow run": _run_name() if flow_run.id else "",
        },
        artifacts=artifacts_of(evidence),  # the culprit's stack dump or profile, to open from the message
    )


def _what(decision: Decision) -> str:
    return (
        f"observe mode, would have: {decision.action.value}" if observed(decision) else decision.action.value
    )


def _kept_files(incident_id: str) -> tuple[Artifact, ...]:
    """The files the incident's stages kept so far: the host evidence read before a reboot or
    replacement (medic/tasks/nodes/host_evidence.py)."""
    detail = current().store.incident_detail(incident_id)
    return step_artifacts(s.detail for s in detail.steps) if detail is not None else ()


def _jobs_to_resume(incident_id: str, triaged: Triage, acted: ActOutcome) -> list[str]:
    """The incident's jobs when the act took the node out, and every job a diagnostic or the act moved
    off it already, whatever the act did (failed, escalated): those are waited on, not requeued again."""
    wanted = triaged.jobs if acted.took_node_out else []
    moved = moved_jobs(current(), incident_id)
    return list(dict.fromkeys([*wanted, *moved]))


def closing_status(acted: ActOutcome, verified: VerifyOutcome | None) -> IncidentStatus:
    """Escalated when the action did not happen or the node failed its verification."""
    # An observed fault is people's to act on: GPU Medic did nothing about it.
    handed = acted.status in (ActStatus.ESCALATED, ActStatus.OBSERVED)
    failed = handed or (verified is not None and not verified.passed)
    return IncidentStatus.ESCALATED if failed else IncidentStatus.CLOSED


def outcome_of(
    incident_id: str,
    node: str,
    decision: Decision,
    acted: ActOutcome,
    resumed: ResumeOutcome | None,
    verified: VerifyOutcome | None,
    seen: list[str],
    notified: bool,
    summary: str,
) -> Outcome:
    return Outcome(
        incident=incident_id,
        node=node,
        classification=decision.classification.value,
        action=decision.action.value,
        rule=decision.rule,
        reason=decision.reason,
        act=acted.status,
        resumed=resumed,
        verified=verified,
        diagnostics=seen,
        notified=notified,
        summary=summary,
    )


def _decided(d: DecisionRecord) -> tuple[object, ...]:
    return (
        d.policy_sha256,
        d.rule,
        d.classification,
        d.action,
        d.diagnose_level,
        d.reason,
        d.guardrail,
        d.blocked_action,
    )


def as_it_happened(detail: IncidentDetail) -> IncidentDetail:
    """The audit as a reader follows it: a decision the policy merely repeated (triage's first
    answer confirmed by `decide` on the same evidence) once, and the node actions in the order they
    were carried out. An action's row is written when it is claimed, before the drain it includes,
    so it is ordered by when it finished."""
    decisions = [
        d
        for i, d in enumerate(detail.decisions)
        if i == 0 or _decided(d) != _decided(detail.decisions[i - 1])
    ]
    actions = sorted(detail.actions, key=lambda a: a.finished_at or a.intent_at)
    return replace(detail, decisions=decisions, actions=actions)


async def _publish(incident_id: str, node: str, summary: str) -> None:
    """The audit artifact, and a link to the incident's record: this run's page, to share, where the
    Prefect UI's address is known."""
    detail = current().store.incident_detail(incident_id)
    if detail is not None:
        await acreate_markdown_artifact(
            markdown=incident_markdown(as_it_happened(detail)), key=incident_id, description=summary
        )
    page = url_for("flow-run", obj_id=flow_run.id) if flow_run.id else None
    if page:
        await acreate_link_artifact(
            link=page,
            link_text=f"Incident {incident_id} on {node}",
            key=f"{incident_id}-record",
            description=f"The incident's full record: `medic incident {incident_id}` prints it step by step.",
        )


@flow(name="remediate-incident", flow_run_name=_run_name, log_prints=False, persist_result=False)
async def remediate(incident_id: str, node: str) -> Outcome:
    record = current().store.get_incident(incident_id)
    if record is not None and record.status in TERMINAL_INCIDENT_STATUSES:
        # A second start for one incident (a trigger fired twice, a run restarted): nothing twice.
        get_run_logger().info("incident %s is already %s; nothing to do", incident_id, record.status)
        return Outcome(
            incident=incident_id,
            node=node,
            classification=record.classification or "unknown",
            action=record.action or "none",
            rule=record.rule or "-",
            reason="already handled",
            act=ActStatus.SKIPPED,
            summary=f"already {record.status}: {record.outcome or ''}",
        )
    await ensure_limits()
    triaged = triage(incident_id)
    thread = IncidentThread(
        incident_id, first_message(triaged, triaged.decision, current().store.incident_events(incident_id))
    )
    decision, seen = await _diagnosed(triaged, thread)
    decision = await _approved(triaged, decision, thread)
    acted = await _acted(triaged, decision, thread)
    to_resume = _jobs_to_resume(incident_id, triaged, acted)
    checking = _start_verify(incident_id, node, decision, acted, to_resume)
    # A hung job kept on its nodes is restarted there: else only its watchdog ends the hang. Not for a
    # switch's incident: behind a switch that failed, the same nodes would hang again.
    kept = not to_resume and decision.mode is not Mode.OBSERVE and (record is None or record.scope == "node")
    hung = hung_jobs(current().store.incident_events(incident_id)) if kept else {}
    resumed, still_hung = await _restarted_hung(incident_id, node, hung, thread)
    # Left alone (any containment released by the act): the node serves on, and so do its jobs.
    left = decision.action is Action.NONE and triaged.jobs and not to_resume and not hung
    stayed = in_place(node, triaged.jobs) if left else None
    resumed = await _resumed(incident_id, node, to_resume, thread) or resumed
    verified = None
    if checking is not None:
        verified = checking.result()
        await thread.say(verified.detail)

    summary = summary_of(decision, acted, resumed, verified, stayed)
    await thread.say(f"Closed: {summary}")
    status = IncidentStatus.ESCALATED if still_hung else closing_status(acted, verified)
    close(incident_id, summary, status=status)
    await _publish(incident_id, node, summary)
    await thread.flush()  # the one wait on chat, bounded (medic/tasks/notify.py FLUSH_S), after all else
    return outcome_of(incident_id, node, decision, acted, resumed, verified, seen, thread.ok, summary)


async def _diagnosed(triaged: Triage, thread: IncidentThread) -> tuple[Decision, list[str]]:
    """The decision once the DCGM ladder the policy asks for has run (and the levels it saw), or the
    policy's answer on the evidence as it stands."""
    decision, seen = triaged.decision, []
    if decision.action is Action.DIAGNOSE and decision.mode is not Mode.OBSERVE:
        await thread.open()  # a ladder can take an hour: people hear of the fault first
        ladder = await diagnose_ladder(triaged.incident, triaged.node, decision)
        decision, seen = ladder.decision, ladder.seen
        for result in seen:
            await thread.say(f"DCGM {result}")
    if not seen:
        decision = decide_incident(triaged.incident)
    elif decision.action is Action.DIAGNOSE and decision.mode is not Mode.OBSERVE:
        decision = decision.model_copy(
            update={"action": Action.ESCALATE, "reason": decision.reason + "; ladder exhausted"}
        )
    return decision, seen


async def _approved(triaged: Triage, decision: Decision, thread: IncidentThread) -> Decision:
    """The decision after a human's answer where the policy asks for one: refused or unanswered, the
    incident escalates with the action it blocked."""
    # Observed, nothing is done: there is nothing to approve.
    asks = decision.approve and decision.mode is not Mode.OBSERVE
    if not asks or decision.action in (Action.NONE, Action.ESCALATE):
        return decision
    await thread.open()
    with stage(
        current().store, triaged.incident, "approval", node=triaged.node, why=decision.action.value
    ) as log:
        answer = await await_approval(triaged, decision)
        log.done(answer.detail, drain=answer.drain)
    if answer.approved:
        return decision
    return decision.model_copy(
        update={
            "action": Action.ESCALATE,
            "blocked_action": decision.action,
            "reason": f"{decision.reason}; {answer.detail}",
        }
    )


async def _acted(triaged: Triage, decision: Decision, thread: IncidentThread) -> ActOutcome:
    state: State[ActOutcome] = act(triaged.incident, triaged.node, triaged.gpu, decision, return_state=True)
    if state.is_completed():
        acted = await state.aresult()
    else:
        # Retries exhausted: never silently dropped — the incident escalates with the error.
        acted = ActOutcome(
            action=decision.action, status=ActStatus.ESCALATED, detail=f"action failed: {state.message}"
        )
    await thread.attach(_kept_files(triaged.incident))
    if acted.status == ActStatus.OBSERVED:
        await thread.say(acted.detail[0].upper() + acted.detail[1:])
    else:
        await thread.say(
            f"Decision: {decision.action.value} (rule `{decision.rule}`) — {acted.status}: {acted.detail}"
        )
    await _tag_run(triaged, decision)
    return acted


def _start_verify(
    incident_id: str, node: str, decision: Decision, acted: ActOutcome, to_resume: list[str]
) -> PrefectFuture[VerifyOutcome] | None:
    """After a repair this incident carried out: the spare lent to the moved jobs, and the node's
    verification started beside the wait on them."""
    if not (acted.verified_here(incident_id) and decision.action in DESTRUCTIVE):
        return None
    if to_resume:
        # The spare goes to the moved jobs before the repaired node is checked: a node that
        # passes refills the pool only once it is short (medic/tasks/nodes/spares.py).
        lend_spare(current(), incident_id, node)
    # The deep checks a replacement or repair requires can take hours (DCGM level 4, an
    # all-reduce): the task's limit is theirs. Checked beside the wait on the moved jobs, not
    # after it: with no spare and no idle node, the repaired node is what they wait for.
    policy = current().policy().policy
    level = policy.defaults.verify_level
    budget = verify_budget_s(policy.deep_checks, level, decision.action)
    return verify.with_options(timeout_seconds=budget).submit(incident_id, node, level, decision.action)


async def _restarted_hung(
    incident_id: str, node: str, hung: Mapping[str, datetime], thread: IncidentThread
) -> tuple[ResumeOutcome | None, bool]:
    """Each hung job restarted on its nodes: the last restart, and whether one failed (a restart that
    failed is people's to finish: the incident escalates)."""
    resumed, still_hung = None, False
    for job, hung_at in hung.items():
        state: State[ResumeOutcome | None] = restart_hung_job(
            incident_id, node, job, hung_at, return_state=True
        )
        if not state.is_completed():
            still_hung = True
            await thread.say(f"Job {job} is hung and could not be restarted: {state.message}")
        elif restarted := await state.aresult():
            resumed = restarted
            await thread.say(f"Job {job} was hung, restarted before its watchdog: {restarted.describe()}")
    return resumed, still_hung


async def _resumed(
    incident_id: str, node: str, to_resume: list[str], thread: IncidentThread
) -> ResumeOutcome | None:
    """Each job moved off the node, requeued or waited on until it trains again: the last one."""
    resumed = None
    for job in to_resume:
        state: State[ResumeOutcome] = resume_job(incident_id, job, [node], return_state=True)
        if state.is_completed():
            resumed = await state.aresult()
            await thread.say(resumed.describe().capitalize())
        else:
            get_run_logger().error("job %s did not resume: %s", job, state.message)
    return resumed
