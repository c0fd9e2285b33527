"""Asking a human before an action the policy reserves: pause the flow run for typed input.

The run pauses (Prefect's pause with a RunInput), the owners get a message with Approve and
Reject buttons; `medic serve` turns a click into `resume_flow_run(..., run_input=...)`, and the
Prefect UI's resume form works the same way. Every request and answer goes into the store, and
the answer is replied in the request's thread.
"""

from __future__ import annotations

import asyncio
import os

from prefect import get_run_logger
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import apause_flow_run
from prefect.input import RunInput
from prefect.runtime import flow_run
from pydantic import BaseModel

from medic.policy import Action, Decision, Mode, groups
from medic.policy.approvers import Approvers
from medic.policy.model import DESTRUCTIVE, Approvals
from medic.protocols import Message
from medic.statuses import IncidentStatus
from medic.tasks.nodes.service import take_out_of_service
from medic.tasks.notify import IncidentThread
from medic.tasks.resume import move_jobs_off
from medic.tasks.runtime.process import Runtime, current
from medic.tasks.triage import Triage

# How long the run waits for approver emails still being looked up, then for the approval
# request to reach the chat, before it pauses anyway.
APPROVERS_WAIT_S = 10.0
REQUEST_WAIT_S = 30.0


class Approval(RunInput):
    approved: bool
    by: str
    via: str = "prefect"
    comment: str = ""


class ApprovalOutcome(BaseModel):
    approved: bool
    detail: str
    drain: str | None = None  # what happened to the node while waiting (drained, or kept in service and why)


def _poll_seconds() -> int:
    # Prefect's default (10 s) is a long time to keep a drained node waiting after a click.
    return int(os.environ.get("MEDIC_APPROVAL_POLL_SECONDS", "2"))


async def await_approval(triaged: Triage, decision: Decision) -> ApprovalOutcome:
    rt = current()
    policy = rt.policy().policy
    approvals = groups.approvals_for(policy, groups.named(policy, decision.group))
    action = decision.action.value
    drain, kept = None, ""
    if decision.action in DESTRUCTIVE:
        # Keep new work off a suspect node while humans think about it: a drain like any other, so
        # the guardrails are checked again under the slot first, and a full fleet keeps it in service.
        intent = decision.model_copy(update={"action": Action.DRAIN, "diagnose_level": None})
        taken = take_out_of_service(rt, triaged.incident, triaged.node, intent, f"{action} awaiting approval")
        drain = taken.detail
        if taken.stopped:
            name, why = taken.stopped
            kept = f"\n{triaged.node} is kept in service while you decide: drain stopped by guardrail {name}: {why}."
        elif decision.mode is Mode.CONTAIN:
            # Contain mode takes the node out for good while people decide: its jobs go elsewhere now.
            off = move_jobs_off(rt, triaged.incident, triaged.node)
            drain = "; ".join(p for p in (drain, off.detail, off.stuck) if p)
            kept = f"\n{_contained(decision)}: {drain}."
    request = rt.store.request_approval(triaged.incident, action)
    rt.store.update_incident(triaged.incident, status=IncidentStatus.WAITING_FOR_APPROVAL)
    approvers = await asyncio.to_thread(rt.approvers, APPROVERS_WAIT_S)
    unresolved = "".join(f"\nApprover {problem}." for problem in approvers.problems)
    run_id = str(flow_run.id) if flow_run.id else None
    ask = IncidentThread(
        triaged.incident,
        Message(
            incident=triaged.incident,
            channel=triaged.channel,
            title=f"Approval needed: {action} {triaged.node}",
            body=f"Rule `{decision.rule}`: {decision.reason}\nNo answer within "
            f"{approvals.timeout_minutes:g} min: {approvals.on_timeout}.{kept}{unresolved}",
            recommend=tuple(decision.recommend),
            fields={"node": triaged.node, "jobs": ", ".join(triaged.jobs), "owner": triaged.owner or ""},
            approval_run=run_id,
        ),
    )
    if approvers.problems:
        get_run_logger().warning("approvers not resolved: %s", "; ".join(approvers.problems))
    # Sent before the run pauses; a chat outage must not decide: past the bound the request
    # keeps being retried in the background, and the Prefect UI answers it meanwhile.
    if not await ask.delivered(REQUEST_WAIT_S):
        get_run_logger().warning(
            "approval request not delivered within %g s; still trying, answer it in the Prefect UI",
            REQUEST_WAIT_S,
        )
    if decision.mode is Mode.CONTAIN:
        # No repair in contain mode without a human's yes, whatever the policy says of silence.
        approvals = approvals.model_copy(update={"on_timeout": "escalate"})
    outcome = await _answer(rt, request.id or 0, approvals, approvers, drain)
    await ask.say(outcome.detail)
    return outcome


def _contained(decision: Decision) -> str:
    where = f"Group {decision.group} is" if decision.group else "This node is"
    return f"{where} in contain mode: GPU Medic took the node out and moved its jobs off; the repair waits for you"


async def _answer(
    rt: Runtime, request_id: int, approvals: Approvals, approvers: Approvers, drain: str | None
) -> ApprovalOutcome:
    """Pause for the answer and record it."""
    try:
        answer = await apause_flow_run(
            wait_for_input=Approval,
            timeout=max(1, round(approvals.timeout_minutes * 60)),
            poll_interval=_poll_seconds(),
            key=f"approval-{request_id}",
        )
    except FlowPauseTimeout:
        proceed = approvals.on_timeout == "proceed"
        rt.store.answer_approval(request_id, approved=None, by=None, via="timeout")
        return ApprovalOutcome(
            approved=proceed,
            detail=f"no answer within {approvals.timeout_minutes:g} min: {approvals.on_timeout}",
            drain=drain,
        )
    # A Slack click arrives with the clicking user's id; the Prefect UI's form may give the id
    # or the email as listed. A display name is never enough.
    allowed = approvers.ids | set(approvals.approvers)
    if approvals.approvers and answer.by not in allowed:
        rt.store.answer_approval(
            request_id, approved=False, by=answer.by, via=answer.via, comment="not an approver"
        )
        return ApprovalOutcome(
            approved=False, detail=f"{answer.by} is not an approver; treated as rejected", drain=drain
        )
    rt.store.answer_approval(
        request_id, approved=answer.approved, by=answer.by, via=answer.via, comment=answer.comment
    )
    verdict = "approved" if answer.approved else "rejected"
    return ApprovalOutcome(
        approved=answer.approved, detail=f"{verdict} by {answer.by} via {answer.via}", drain=drain
    )
