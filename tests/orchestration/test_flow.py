"""The remediation flow, run for real on Prefect (test harness), on SQLite and PostgreSQL stores."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from checkout import REPO_ROOT
from factories import fault_event
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from medic.artifacts import Artifact
from medic.errors import PermanentError
from medic.flows.dispatch import Dispatch, remediate_all
from medic.flows.remediate import remediate
from medic.intake import Intake, read_lines
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.sim.notifier import RecordingNotifier
from medic.protocols import Message, NodeState
from medic.tasks.runtime.process import Runtime

pytestmark = pytest.mark.usefixtures("prefect_harness")

T0 = datetime.now(UTC) - timedelta(minutes=5)


def line(n: int, kind: str, node: str, seconds: float = 0, **fields: Any) -> str:
    event = fault_event(kind, id=f"ev-{node}-{n}", node=node, at=T0, seconds=seconds, **fields)
    return event.model_dump_json()


def run(rt: Runtime, lines: list[str]) -> Dispatch:
    return asyncio.run(remediate_all(rt, read_lines(lines, "test.jsonl")))


def node_calls(fleet: SimFleet, node: str) -> list[str]:
    return [action for target, action in fleet.calls if target == node]


@pytest.fixture
def training(fleet: SimFleet) -> Iterator[SimFleet]:
    fleet.add_job("llm", "alice", ["gpu-node-1", "gpu-node-2"], step=1_234, checkpoint_every=100)
    fleet.crash_job("llm")
    yield fleet


def test_xid79_reboots_resumes_job_and_reintegrates(runtime: Runtime, training: SimFleet) -> None:
    storm = [
        line(i, "xid", "gpu-node-1", i * 0.1, gpu=3, job="llm", attributes={"code": 79}) for i in range(25)
    ]
    dispatch = run(runtime, storm)

    assert len(dispatch.incidents) == 1 and not dispatch.failed
    (outcome,) = dispatch.outcomes
    assert (outcome.classification, outcome.action, outcome.rule) == (
        "hardware",
        "reboot",
        "xid-fallen-off-bus",
    )
    assert outcome.resumed is not None
    assert outcome.resumed.checkpoint_step == 1_200
    assert outcome.resumed.resumed_step > 1_200
    assert "gpu-node-1" not in outcome.resumed.nodes
    assert outcome.verified is not None and outcome.verified.passed
    assert node_calls(training, "gpu-node-1") == ["drain", "reboot", "diagnose-l1", "resume"]
    assert training.nodes["gpu-node-1"].state is NodeState.IDLE

    detail = runtime.store.incident_detail(outcome.incident)
    assert detail is not None
    assert detail.incident.status == "closed"
    assert (detail.incident.owner, detail.incident.jobs) == ("alice", ["llm"])
    assert len(detail.events) == 25
    stages = [s.stage for s in detail.steps]
    # The node is taken out before anyone is told, and no stage waits on the chat: the messages
    # go out beside the stages after it (medic/tasks/notify.py), in their own order.
    chat = ("notify", "update")
    # The job's resume and the node's verification run side by side after the act (either may end
    # first: a job with nowhere else to go waits for the verified node), both before the close.
    flow = [s for s in stages if s not in chat]
    assert flow[:3] == ["triage", "decide", "act: reboot"] and flow[-1] == "close"
    assert sorted(flow[3:-1]) == ["resume job", "verify L1"]
    assert [s for s in stages if s in chat] == ["notify", "update", "update", "update", "update"]
    assert stages.index("notify") > stages.index("act: reboot")
    notifier = runtime.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    (thread,) = notifier.threads.values()  # one message per incident, its story in the thread
    assert thread.message.title == "Hardware fault on gpu-node-1: reboot"
    prefixes = ["Decision: reboot", "Job llm resumed from step 1200", "DCGM level 1 passed", "Closed: "]
    assert len(thread.replies) == len(prefixes)
    assert all(reply.startswith(p) for reply, p in zip(thread.replies, prefixes, strict=True)), thread.replies
    assert {a.action: a.status for a in detail.actions} == {
        "drain": "succeeded",
        "reboot": "succeeded",
        "resume": "succeeded",
    }
    assert all(d.policy_sha256 and d.rule == "xid-fallen-off-bus" for d in detail.decisions)
    # What it cost the job is kept: detection (fault -> received), recovery (fault -> training again).
    (cost,) = runtime.store.goodput("llm")
    assert cost.incident_id == outcome.incident
    first = min(detail.events, key=lambda e: e.time)
    assert cost.detection_s == pytest.approx((first.received_at - first.time).total_seconds())
    assert cost.recovery_s is not None and cost.recovery_s > cost.detection_s
    assert cost.lost_work_s == pytest.approx(outcome.resumed.lost_seconds)


def test_application_fault_leaves_node_alone_and_tells_owner(runtime: Runtime, training: SimFleet) -> None:
    dispatch = run(
        runtime,
        [
            line(1, "nan_loss", "gpu-node-2", job="llm", rank=1, iteration=1_234),
            line(2, "job_crash", "gpu-node-2", 1, job="llm", rank=1, attributes={"exit_code": 1}),
        ],
    )
    (outcome,) = dispatch.outcomes
    assert (outcome.classification, outcome.action, outcome.act) == ("software", "none", "skipped")
    assert node_calls(training, "gpu-node-2") == []
    assert training.nodes["gpu-node-2"].state is NodeState.ALLOCATED
    notifier = runtime.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    (thread,) = notifier.threads.values()
    assert thread.message.fields["owner"] == "alice"
    assert any("restart in place from its last checkpoint" in r for r in thread.message.recommend)
    # Its node stays, so the job is not requeued (a fresh launch elsewhere): it restarts where it is.
    assert outcome.summary.endswith(
        "job llm not requeued: gpu-node-2 stays in service, so a crash restarts in place from the last "
        "checkpoint (torchrun --max-restarts)"
    )
    assert training.jobs["llm"].restarts == 0 and not [c for c in training.calls if c[1] == "requeue"]


def test_same_fault_twice_acts_once(runtime: Runtime, training: SimFleet) -> None:
    events = [line(1, "xid", "gpu-node-1", gpu=0, job="llm", attributes={"code": 79})]
    run(runtime, events)
    second = run(runtime, events)
    assert second.incidents == [] and second.outcomes == []
    assert node_calls(training, "gpu-node-1").count("reboot") == 1


def test_a_second_run_for_a_closed_incident_does_nothing(runtime: Runtime, training: SimFleet) -> None:
    """What a deployment trigger firing twice would do: the second run finds the incident closed."""
    (first,) = run(
        runtime, [line(1, "xid", "gpu-node-1", gpu=0, job="llm", attributes={"code": 79})]
    ).outcomes
    notifier = runtime.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    messages = len(notifier.threads)
    again = asyncio.run(remediate(incident_id=first.incident, node="gpu-node-1"))
    assert (again.act, again.action, again.summary.split(":")[0]) == ("skipped", "reboot", "already closed")
    assert node_calls(training, "gpu-node-1").count("reboot") == 1 and len(notifier.threads) == messages


def test_straggler_climbs_to_level_2_and_replaces(
    runtime: Runtime, training: SimFleet, tmp_path: Path
) -> None:
    # A site that replaces without asking (the default policy asks first: tests/orchestration/test_approval.py).
    runtime.policy_path = tmp_path / "policy.yaml"
    runtime.policy_path.write_text(
        (REPO_ROOT / "policies" / "default.yaml")
        .read_text()
        .replace("required_for: [replace]", "required_for: []")
    )
    training.script_diagnostic("gpu-node-2", 2, "fail", ("DCGM_FR_FAULTY_MEMORY",))
    # The slow rank's own profile, as the differential attaches it to the stragglers about it.
    profile = {"profile_event": "p-1", "artifact": "/shared/medic/llm-r2-step16-profile.pt.trace.json"}
    stragglers = [
        line(
            i,
            "straggler",
            "gpu-node-2",
            i * 10,
            job="llm",
            rank=2,
            attributes={"step_time_ratio": 1.4, **profile},
        )
        for i in range(3)
    ]
    (outcome,) = run(runtime, stragglers).outcomes
    assert outcome.diagnostics == ["L2 fail (DCGM_FR_FAULTY_MEMORY)"]
    assert (outcome.action, outcome.rule) == ("replace", "diag-isolate")
    # Level 2 needs idle GPUs: the node was drained before the test ran.
    assert node_calls(training, "gpu-node-2")[:3] == ["drain", "diagnose-l2", "replace"]
    detail = runtime.store.incident_detail(outcome.incident)
    assert detail is not None
    assert [(d.level, d.result) for d in detail.diagnostics] == [(2, "fail"), (1, "pass")]
    assert [d.rule for d in detail.decisions] == ["sustained-straggler", "diag-isolate"]
    assert any(e.kind == "diagnostic" for e in detail.events)
    # The message says where the evidence's files are.
    notifier = runtime.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    (thread,) = notifier.threads.values()
    assert thread.message.artifacts == (Artifact("profile of rank 2 on gpu-node-2", profile["artifact"]),)


def test_failed_action_is_retried(runtime: Runtime, training: SimFleet) -> None:
    training.fail_next("gpu-node-1", "reboot", times=1)
    (outcome,) = run(runtime, [line(1, "xid", "gpu-node-1", job="llm", attributes={"code": 79})]).outcomes
    assert outcome.act == "done"
    assert node_calls(training, "gpu-node-1").count("reboot") == 2
    detail = runtime.store.incident_detail(outcome.incident)
    assert detail is not None
    reboot = next(a for a in detail.actions if a.action == "reboot")
    assert (reboot.status, reboot.attempts) == ("succeeded", 2)


def test_action_failing_for_good_escalates(runtime: Runtime, training: SimFleet) -> None:
    training.fail_next("gpu-node-1", "reboot", times=10)
    (outcome,) = run(runtime, [line(1, "xid", "gpu-node-1", job="llm", attributes={"code": 79})]).outcomes
    assert outcome.act == "escalated"
    assert outcome.resumed is None and outcome.verified is None
    record = runtime.store.get_incident(outcome.incident)
    assert record is not None and record.status == "escalated"
    # The node stays out of service for a human to look at.
    assert training.nodes["gpu-node-1"].state is NodeState.DRAINED


def test_unfinished_intent_is_not_repeated_blind(runtime: Runtime, training: SimFleet) -> None:
    events = [line(1, "xid", "gpu-node-1", job="llm", attributes={"code": 79})]
    intake = read_lines(events, "x.jsonl")
    incident_id = _incident_id(intake)
    # A previous process claimed the reboot and died before reporting back.
    runtime.store.claim_action(f"{incident_id}:gpu-node-1:reboot", incident_id, "gpu-node-1", "reboot")
    (outcome,) = asyncio.run(remediate_all(runtime, intake)).outcomes
    assert outcome.act == "escalated"
    assert "reboot" not in node_calls(training, "gpu-node-1")


def test_a_claim_lost_in_a_race_does_not_act(
    runtime: Runtime, training: SimFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    from medic.policy import Decision
    from medic.tasks.act import act

    key = "inc-race:gpu-node-1:reboot"
    runtime.store.claim_action(key, "inc-race", "gpu-node-1", "reboot")  # another run, mid-reboot
    monkeypatch.setattr(runtime.store, "get_action", lambda _key: None)  # it claimed after our look
    decision = Decision(incident="inc-race", classification="hardware", action="reboot", rule="r", reason="-")
    outcome = act.fn("inc-race", "gpu-node-1", 0, decision)
    assert outcome.status == "escalated" and "not repeating it blind" in outcome.detail
    assert "reboot" not in node_calls(training, "gpu-node-1")


def _incident_id(intake: Intake) -> str:
    from medic.incidents import correlate

    return correlate(intake.events)[0].id


def test_notification_outage_does_not_stop_remediation(
    runtime: Runtime, training: SimFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("medic.tasks.notify.FLUSH_S", 1.0)

    class Down:
        def post(self, message: Message) -> str:
            raise ConnectionError("slack is down")

        def reply(self, thread: str, text: str) -> None:
            raise ConnectionError("slack is down")

    runtime.backends.notifier = Down()
    (outcome,) = run(runtime, [line(1, "xid", "gpu-node-1", job="llm", attributes={"code": 48})]).outcomes
    assert (outcome.action, outcome.act, outcome.notified) == ("reset_gpu", "done", False)
    detail = runtime.store.incident_detail(outcome.incident)
    assert detail is not None and detail.incident.status == "closed"
    # Tried until the run's final flush, then given up and recorded: the message and each reply
    # (no thread to reply in), none dropped in silence.
    assert [s.status for s in detail.steps if s.stage == "notify"] == ["failed"]
    assert [s.status for s in detail.steps if s.stage == "update"] == ["failed"] * 4


def test_bad_lines_are_kept_and_the_rest_runs(runtime: Runtime, training: SimFleet) -> None:
    dispatch = run(runtime, ["{nope", line(1, "xid", "gpu-node-1", job="llm", attributes={"code": 79}), "[]"])
    assert dispatch.rejected == 2
    assert [r.origin for r in runtime.store.rejections()] == ["test.jsonl:1", "test.jsonl:3"]
    assert len(dispatch.outcomes) == 1


def test_run_history_reads_as_an_audit(runtime: Runtime, training: SimFleet) -> None:
    (outcome,) = run(
        runtime, [line(1, "xid", "gpu-node-1", job="llm", gpu=2, attributes={"code": 79})]
    ).outcomes
    record = runtime.store.get_incident(outcome.incident)
    assert record is not None and record.flow_run_id is not None
    assert record.flow_run_name == f"{outcome.incident}-gpu-node-1"

    async def read_back() -> tuple[Any, list[Any]]:
        async with get_client() as client:
            flow_run = await client.read_flow_run(UUID(record.flow_run_id))
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
            )
            return flow_run, artifacts

    flow_run, artifacts = asyncio.run(read_back())
    assert flow_run.name == record.flow_run_name
    assert flow_run.state.is_completed()
    assert {"node:gpu-node-1", "job:llm", "owner:alice", "classification:hardware", "action:reboot"} <= set(
        flow_run.tags
    )
    by_key = {a.key: a for a in artifacts}
    assert set(by_key) == {outcome.incident, f"{outcome.incident}-record"}
    audit = by_key[outcome.incident].data
    for heading in ("## Evidence", "## Decisions", "## Actions", "## Stages", "xid-fallen-off-bus"):
        assert heading in audit
    # Each decision once (triage's first answer, confirmed by `decide`), the actions as carried out.
    assert audit.count("**reboot** (hardware) by rule `xid-fallen-off-bus`") == 1
    actions = audit.split("## Actions")[1].split("##")[0]
    assert [line.split(" on ")[0] for line in actions.strip().splitlines()] == [
        "- drain",
        "- reboot",
        "- resume",
    ]
    # The link to the incident's record: its run's page in the UI, and the command that prints it.
    link = by_key[f"{outcome.incident}-record"]
    assert (
        f"/runs/flow-run/{flow_run.id}" in link.data
        and f"medic incident {outcome.incident}" in link.description
    )


def test_medic_events_reach_prefects_feed(runtime: Runtime, training: SimFleet) -> None:
    from prefect.events.filters import EventFilter, EventResourceFilter

    (outcome,) = run(runtime, [line(1, "xid", "gpu-node-1", job="llm", attributes={"code": 79})]).outcomes
    wanted = {"medic.fault.received", "medic.incident.opened", "medic.action.reboot", "medic.incident.closed"}
    resource = EventResourceFilter(id=[f"medic.incident.{outcome.incident}"])
    deadline = time.monotonic() + 30
    seen: set[str] = set()
    while not wanted <= seen and time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            page = client.read_events(filter=EventFilter(resource=resource), limit=50)
        seen = {e.event for e in page.events}
        time.sleep(0.5)
    assert wanted <= seen
    related = {r.id for e in page.events for r in e.related}
    assert {"medic.node.gpu-node-1", "medic.job.llm"} <= related


def test_a_node_someone_else_drained_is_never_rebooted(runtime: Runtime, training: SimFleet) -> None:
    admin = "RMA ticket 4711: HBM errors, do not touch"
    runtime.backends.scheduler.drain("gpu-node-1", admin)
    (outcome,) = run(runtime, [line(1, "xid", "gpu-node-1", job="llm", attributes={"code": 79})]).outcomes
    assert outcome.act == "escalated"
    assert "reboot" not in node_calls(training, "gpu-node-1")
    record = runtime.store.get_incident(outcome.incident)
    assert record is not None and record.status == "escalated"
    node = runtime.backends.scheduler.node("gpu-node-1")
    assert (node.state, node.reason) == (NodeState.DRAINED, admin)


def test_a_reboot_never_seen_to_happen_escalates_with_the_node_held(
    runtime: Runtime, training: SimFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never_went_down(node: str, timeout_s: float) -> bool:
        raise PermanentError(f"{node} was never seen to go down after the reboot")

    monkeypatch.setattr(runtime.backends.provider, "wait_ready", never_went_down)
    (outcome,) = run(runtime, [line(1, "xid", "gpu-node-1", job="llm", attributes={"code": 79})]).outcomes
    assert outcome.act == "done" and outcome.verified is not None and not outcome.verified.passed
    assert "never seen to go down" in outcome.verified.detail
    record = runtime.store.get_incident(outcome.incident)
    assert record is not None and record.status == "escalated"
    # Still out of service, as the reboot left it: nothing resumed it.
    assert training.nodes["gpu-node-1"].state is NodeState.REBOOTING
    assert "resume" not in node_calls(training, "gpu-node-1")


def test_a_run_that_died_after_its_reboot_is_finished_by_the_next(
    runtime: Runtime, training: SimFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica killed between the reboot and its verification: the incident's next run finds the
    reboot done (not repeated) and verifies and brings the node back, rather than closing with the node
    left out of service. The default policy's node cooldown does not count the incident's own reboot
    against it."""
    import medic.flows.remediate as remediate_flow

    events = [line(1, "xid", "gpu-node-1", job="llm", attributes={"code": 79})]
    intake = read_lines(events, "x.jsonl")
    incident_id = _incident_id(intake)

    class Died:
        def with_options(self, **_: object) -> Any:
            def died(*_: object) -> None:
                raise RuntimeError("the replica was killed here")

            return died

    with monkeypatch.context() as crash:
        crash.setattr(remediate_flow, "verify", Died())
        first = asyncio.run(remediate_all(runtime, intake))
    assert first.outcomes == [] and first.failed
    assert node_calls(training, "gpu-node-1").count("reboot") == 1
    record = runtime.store.get_incident(incident_id)
    assert record is not None and record.status not in ("closed", "escalated")

    again = asyncio.run(remediate(incident_id=incident_id, node="gpu-node-1"))
    assert again.act == "already-done"
    assert again.verified is not None and again.verified.passed, again.summary
    assert "resumed gpu-node-1" in again.verified.detail
    assert node_calls(training, "gpu-node-1").count("reboot") == 1
    assert training.nodes["gpu-node-1"].state is not NodeState.DRAINED
    record = runtime.store.get_incident(incident_id)
    assert record is not None and record.status == "closed"
