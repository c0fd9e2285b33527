"""Approvals: a real paused flow run, resumed with typed input; rejection and timeout escalate."""

from __future__ import annotations

import asyncio
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest
from approval_support import paused_run, run_in_background
from checkout import REPO_ROOT
from factories import fault_event
from prefect.flow_runs import resume_flow_run

from medic.flows.dispatch import Dispatch, remediate_all
from medic.intake import read_lines
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.sim.notifier import RecordingNotifier
from medic.protocols import NodeState
from medic.tasks.runtime.process import Runtime

pytestmark = pytest.mark.usefixtures("prefect_harness")

APPROVALS = """
approvals:
  approvers: [U0ALICE]
  required_for: [reboot]
  timeout_minutes: {minutes}
"""


@pytest.fixture
def needs_approval(runtime: Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Runtime:
    monkeypatch.setenv("MEDIC_APPROVAL_POLL_SECONDS", "1")
    path = tmp_path / "policy.yaml"
    shutil.copy(REPO_ROOT / "policies" / "default.yaml", path)
    runtime.policy_path = path
    return runtime


def set_timeout(rt: Runtime, minutes: float) -> None:
    """The default policy's approvals block, replaced by APPROVALS."""
    text = rt.policy_path.read_text()
    start = text.index("\napprovals:\n")
    end = text.index("\n\n", start)
    rt.policy_path.write_text(text[:start] + APPROVALS.format(minutes=minutes).rstrip("\n") + text[end:])


def xid79(node: str) -> list[str]:
    return [fault_event(id=f"appr-{node}", node=node, at=datetime.now(UTC)).model_dump_json()]


def test_approved_by_an_approver_acts(needs_approval: Runtime, fleet: SimFleet) -> None:
    set_timeout(needs_approval, 5)
    thread, result = run_in_background(needs_approval, xid79("gpu-node-1"))
    run_id = paused_run(needs_approval, "gpu-node-1")
    # While it waits, the suspect node takes no new work, and the humans were asked.
    assert fleet.nodes["gpu-node-1"].state is NodeState.DRAINED
    notifier = needs_approval.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    asks = [t.message for t in notifier.threads.values() if t.message.approval_run]
    assert asks and asks[0].approval_run == str(run_id)
    resume_flow_run(run_id, run_input={"approved": True, "by": "U0ALICE", "via": "prefect"})
    thread.join(timeout=120)
    dispatch: Dispatch = result["dispatch"]
    (outcome,) = dispatch.outcomes
    assert (outcome.action, outcome.act) == ("reboot", "done")
    assert fleet.nodes["gpu-node-1"].boots == 1
    (approval,) = needs_approval.store.approvals(outcome.incident)
    assert (approval.approved, approval.by, approval.via) == (True, "U0ALICE", "prefect")
    # The answer is told in the request's thread.
    (ask,) = [t for t in notifier.threads.values() if t.message.approval_run]
    assert ask.replies == ["approved by U0ALICE via prefect"]


@pytest.mark.parametrize(
    ("by", "approved"),
    [("U0ALICE", False), ("U0MALLORY", True), ("alice", True)],
    ids=["rejected", "not-approver", "an-approver's-name-is-not-enough"],
)
def test_rejected_or_unauthorised_answers_escalate(
    needs_approval: Runtime, fleet: SimFleet, by: str, approved: bool
) -> None:
    set_timeout(needs_approval, 5)
    thread, result = run_in_background(needs_approval, xid79("gpu-node-2"))
    resume_flow_run(paused_run(needs_approval, "gpu-node-2"), run_input={"approved": approved, "by": by})
    thread.join(timeout=120)
    (outcome,) = result["dispatch"].outcomes
    assert outcome.action == "escalate" and fleet.nodes["gpu-node-2"].boots == 0
    # Nothing was rebooted; the node stays out of service for a human.
    assert fleet.nodes["gpu-node-2"].state is NodeState.DRAINED
    (answer,) = needs_approval.store.approvals(outcome.incident)
    assert (answer.approved, answer.by) == (False, by)
    assert answer.comment == ("" if by == "U0ALICE" else "not an approver")


def test_no_answer_in_time_escalates(needs_approval: Runtime, fleet: SimFleet) -> None:
    set_timeout(needs_approval, 0.05)  # three seconds
    dispatch = asyncio.run(remediate_all(needs_approval, read_lines(xid79("gpu-node-4"), "t.jsonl")))
    (outcome,) = dispatch.outcomes
    assert outcome.action == "escalate" and "no answer within" in outcome.reason
    (approval,) = needs_approval.store.approvals(outcome.incident)
    assert (approval.approved, approval.via) == (None, "timeout")
    assert fleet.nodes["gpu-node-4"].boots == 0


def test_an_approver_email_that_cannot_be_resolved_is_said_in_the_request(
    needs_approval: Runtime, fleet: SimFleet
) -> None:
    set_timeout(needs_approval, 0.05)
    text = needs_approval.policy_path.read_text()
    needs_approval.policy_path.write_text(
        text.replace("approvers: [U0ALICE]", "approvers: [U0ALICE, ghost@example.com]", 1)
    )
    asyncio.run(remediate_all(needs_approval, read_lines(xid79("gpu-node-5"), "t.jsonl")))
    notifier = needs_approval.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    (ask,) = [t.message for t in notifier.threads.values() if t.message.approval_run]
    # No Slack here to look the email up: the request says so, and only the listed id may answer.
    assert "Approver ghost@example.com: not resolved, Slack is not configured" in ask.body
    assert needs_approval.approvers().ids == {"U0ALICE"}
