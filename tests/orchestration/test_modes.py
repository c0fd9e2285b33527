"""Node groups' modes in the real flows, on the simulated fleet (decision 0017): observe touches nothing
and says what it would have done, contain takes the node out and waits for approval before the repair,
remediate acts as before, and a node whose group cannot be told is left alone and escalated."""

from __future__ import annotations

import asyncio
import shutil
from datetime import UTC, datetime
from pathlib import Path
from uuid import UUID

import pytest
from approval_support import paused_run, run_in_background
from checkout import REPO_ROOT
from factories import fault_event
from prefect.client.orchestration import get_client
from prefect.flow_runs import resume_flow_run

from medic.audit import incident_markdown
from medic.flows.dispatch import Dispatch, remediate_all
from medic.incidents import Incident
from medic.intake import read_lines
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.sim.notifier import RecordingNotifier
from medic.protocols import NodeState
from medic.store import Store
from medic.tasks.nodes.contain import contain
from medic.tasks.runtime.process import Runtime

pytestmark = pytest.mark.usefixtures("prefect_harness")

GROUPS = """
groups:
  - name: watch
    select: {hostlist: ["gpu-node-[1-2]"]}
    mode: observe
  - name: hold
    select: {hostlist: ["gpu-node-[3-4]"]}
    mode: contain
  - name: racks
    select: {features: [nvl72]}
    mode: remediate
"""


@pytest.fixture
def store(sqlite_store: Store) -> Store:
    return sqlite_store  # the modes are the flow's, not the database's: one store kind is enough


@pytest.fixture
def fleet() -> SimFleet:
    return SimFleet.build(nodes=30)  # the default policy's 10% lets 3 out: a group's own limit is seen


@pytest.fixture
def grouped(runtime: Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Runtime:
    monkeypatch.setenv("MEDIC_APPROVAL_POLL_SECONDS", "1")
    path = tmp_path / "policy.yaml"
    shutil.copy(REPO_ROOT / "policies" / "default.yaml", path)
    path.write_text(path.read_text() + GROUPS)
    runtime.policy_path = path
    return runtime


def xid79(node: str, job: str | None = None) -> str:
    return fault_event(id=f"mode-{node}", node=node, job=job, at=datetime.now(UTC)).model_dump_json()


def run(rt: Runtime, lines: list[str]) -> Dispatch:
    return asyncio.run(remediate_all(rt, read_lines(lines, "t.jsonl")))


def on(fleet: SimFleet, *names: str) -> list[tuple[str, str]]:
    return [call for call in fleet.calls if call[0] in names]


def replies(rt: Runtime, incident: str) -> list[str]:
    notifier = rt.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    return [reply for t in notifier.threads.values() if t.message.incident == incident for reply in t.replies]


async def tags(run_id: str) -> list[str]:
    async with get_client() as client:
        return list((await client.read_flow_run(UUID(run_id))).tags)


def test_observe_touches_nothing_and_says_what_it_would_have_done_beside_a_node_that_remediates(
    grouped: Runtime, fleet: SimFleet
) -> None:
    fleet.add_job("llm", "alice", ["gpu-node-1", "gpu-node-2"])
    # An incident on an observed node never reaches the containment drain before its flow either.
    early = fault_event(id="mode-early", node="gpu-node-2", at=datetime.now(UTC))
    grouped.store.record_accepted([early])
    grouped.store.open_incident(Incident(id="inc-early", node="gpu-node-2", events=[early]))
    assert contain(grouped, "inc-early", "gpu-node-2", "node") is None

    dispatch = run(grouped, [xid79("gpu-node-1", "llm"), xid79("gpu-node-6")])

    observed, acted = sorted(dispatch.outcomes, key=lambda o: o.node)
    assert (observed.node, observed.action, observed.act) == ("gpu-node-1", "reboot", "observed")
    assert on(fleet, "gpu-node-1", "gpu-node-2", "llm") == []
    assert fleet.nodes["gpu-node-1"].state is NodeState.ALLOCATED and fleet.jobs["llm"].restarts == 0
    said = replies(grouped, observed.incident)
    assert any(r.startswith("Would have: reboot gpu-node-1 (rule xid-fallen-off-bus)") for r in said), said
    record = grouped.store.get_incident(observed.incident)
    assert record is not None and record.status == "escalated"  # the fault is people's to act on
    decisions = grouped.store.incident_detail(observed.incident)
    assert decisions is not None
    assert {(d.mode, d.node_group, d.action) for d in decisions.decisions} == {("observe", "watch", "reboot")}
    assert "**reboot** in observe mode, group watch (hardware)" in incident_markdown(decisions)
    assert record.flow_run_id and {"mode:observe", "group:watch"} <= set(
        asyncio.run(tags(record.flow_run_id))
    )

    # gpu-node-6 is in no group: the policy's mode, remediate, exactly as before groups.
    assert (acted.node, acted.action, acted.act) == ("gpu-node-6", "reboot", "done")
    assert [a for _, a in on(fleet, "gpu-node-6")][:2] == ["drain", "reboot"]
    other = grouped.store.incident_detail(acted.incident)
    assert other is not None and {(d.mode, d.node_group) for d in other.decisions} == {("remediate", None)}


def test_contain_takes_the_node_out_and_moves_the_job_but_reboots_only_once_approved(
    grouped: Runtime, fleet: SimFleet
) -> None:
    fleet.add_job("llm", "alice", ["gpu-node-3", "gpu-node-5"])
    thread, result = run_in_background(grouped, [xid79("gpu-node-3", "llm")])
    run_id = paused_run(grouped, "gpu-node-3")

    assert fleet.nodes["gpu-node-3"].state is NodeState.DRAINED
    assert ("llm", "requeue") in fleet.calls and "gpu-node-3" not in fleet.jobs["llm"].nodes
    assert fleet.nodes["gpu-node-3"].boots == 0 and ("gpu-node-3", "reboot") not in fleet.calls
    notifier = grouped.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    (ask,) = [t.message for t in notifier.threads.values() if t.message.approval_run]
    assert ask.approval_run == str(run_id) and "Group hold is in contain mode" in ask.body

    resume_flow_run(run_id, run_input={"approved": True, "by": "U0ALICE", "via": "slack"})
    thread.join(timeout=120)
    (outcome,) = result["dispatch"].outcomes
    assert (outcome.action, outcome.act) == ("reboot", "done")
    assert fleet.nodes["gpu-node-3"].boots == 1


def test_a_node_whose_group_cannot_be_told_is_left_alone_and_escalated(
    grouped: Runtime, fleet: SimFleet
) -> None:
    fleet.nodes["gpu-node-7"].features = None  # the scheduler does not say: is it an NVL72 rack's?

    (outcome,) = run(grouped, [xid79("gpu-node-7")]).outcomes

    assert (outcome.action, outcome.act) == ("escalate", "escalated")
    assert "node group undecidable: cannot tell whether gpu-node-7 is in group racks" in outcome.reason
    assert on(fleet, "gpu-node-7") == []


def test_a_mode_change_is_in_the_audit_trail_once(grouped: Runtime) -> None:
    grouped.policy()
    text = grouped.policy_path.read_text()
    grouped.policy_path.write_text(text.replace("mode: observe", "mode: contain"))
    grouped.policy()
    grouped.policy()  # the same file again: nothing new

    changes = [(c.node_group, c.previous, c.mode) for c in grouped.store.mode_changes()]
    assert changes == [
        ("hold", None, "contain"),
        ("racks", None, "remediate"),
        ("watch", None, "observe"),
        ("watch", "observe", "contain"),
    ]
    assert all(c.by and len(c.policy_sha256) == 64 for c in grouped.store.mode_changes())
    assert grouped.store.verify_chain().ok


def test_in_contain_mode_silence_never_repairs_and_a_groups_limits_hold_over_its_own_nodes(
    grouped: Runtime, fleet: SimFleet
) -> None:
    text = grouped.policy_path.read_text()
    grouped.policy_path.write_text(
        text.replace(
            "    mode: contain\n",
            # The group's own approvals say proceed on silence: contain mode escalates all the same.
            "    mode: contain\n    approvals: {timeout_minutes: 0.02, on_timeout: proceed}\n",
        ).replace(
            "    mode: remediate\n",
            "    mode: remediate\n    guardrails: {max_out_of_service: 1}\n",
        )
    )
    for name in ("gpu-node-5", "gpu-node-6"):
        fleet.nodes[name].features = ("nvl72",)
    fleet.nodes["gpu-node-5"].state, fleet.nodes["gpu-node-5"].reason = NodeState.DRAINED, "admin: tray swap"

    dispatch = run(grouped, [xid79("gpu-node-4"), xid79("gpu-node-6")])

    silent, limited = sorted(dispatch.outcomes, key=lambda o: o.node)
    assert (silent.node, silent.action) == ("gpu-node-4", "escalate")
    assert "no answer within 0.02 min: escalate" in silent.reason
    assert fleet.nodes["gpu-node-4"].boots == 0 and fleet.nodes["gpu-node-4"].state is NodeState.DRAINED
    # One rack node out already; the fleet's own limit (10% of 30) would allow two more.
    assert (limited.node, limited.action) == ("gpu-node-6", "escalate")
    assert (
        "stopped by guardrail max_out_of_service: 1 nodes already out of service (limit 1) in group racks"
        in (limited.reason)
    )
    assert on(fleet, "gpu-node-6") == []
