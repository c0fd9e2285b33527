"""Containment first: the process that opens an incident drains the node before its flow run, under
the guardrail slot, and leaves alone what the policy does not take out without a human."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from checkout import REPO_ROOT
from factories import event_dict, fault_event
from fastapi.testclient import TestClient
from prefect.client.orchestration import get_client
from waiting import until

from medic.apps.server.app import create_app
from medic.flows.live import LiveDispatcher
from medic.flows.remediate import remediate
from medic.incidents import Incident
from medic.integrations.registry import Backends
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.sim.notifier import RecordingNotifier
from medic.policy import Action
from medic.protocols import NodeState
from medic.statuses import ActStatus, StepStatus
from medic.store import Store
from medic.tasks.act import act
from medic.tasks.nodes import guard
from medic.tasks.nodes.contain import contain
from medic.tasks.nodes.evidence import evaluate
from medic.tasks.nodes.guard import NODE_ACTIONS_LIMIT, ensure_limits, node_actions_slot
from medic.tasks.runtime.process import Runtime, configure

pytestmark = pytest.mark.usefixtures("prefect_harness")

TOKEN = "ingest-token"


@pytest.fixture(autouse=True)
def _limit() -> None:
    asyncio.run(ensure_limits())  # the slot a containment holds lives on the Prefect API


def opened(rt: Runtime, node: str, code: int = 79) -> Incident:
    """An XID on `node` stored and opened as an incident, as the service opens one."""
    event = fault_event(
        "xid", id=f"contain-{uuid.uuid4().hex[:8]}", node=node, at=datetime.now(UTC), code=code
    )
    rt.store.record_accepted([event])
    incident = Incident(id=f"inc-{uuid.uuid4().hex[:8]}", node=node, events=[event])
    rt.store.open_incident(incident)
    return incident


def with_policy(store: Store, backends: Backends, tmp_path: Path, old: str, new: str) -> Runtime:
    policy = tmp_path / "policy.yaml"
    text = (REPO_ROOT / "policies" / "default.yaml").read_text()
    assert old in text
    policy.write_text(text.replace(old, new, 1))
    return configure(Runtime(store, backends, policy))


def test_the_service_drains_the_node_before_its_flow_run_starts(
    runtime: Runtime, fleet: SimFleet, live_dispatcher: Callable[..., LiveDispatcher]
) -> None:
    app = create_app(runtime.store, tokens={TOKEN}, hmac_secret=None, on_accepted=live_dispatcher(runtime))
    with TestClient(app) as client:
        body = event_dict(id="contain-live", node="gpu-node-3", at=datetime.now(UTC))  # XID 79: reboot
        assert client.post("/v1/events", json=body, headers={"Authorization": f"Bearer {TOKEN}"}).is_success

        def closed() -> Any:
            found = runtime.store.find_incidents(node="gpu-node-3")
            return found[0] if found and found[0].status == "closed" else None

        record = until(closed, "the incident to close")
    detail = runtime.store.incident_detail(record.id)
    assert detail is not None
    stages = [s.stage for s in detail.steps]
    assert stages[0] == "contain" and "triage" in stages
    contained = detail.steps[0]
    assert (contained.status, contained.summary) == (StepStatus.OK, "drained gpu-node-3")
    triaged = next(s for s in detail.steps if s.stage == "triage")
    drain = next(a for a in detail.actions if a.action == "drain")
    assert drain.intent_at <= contained.finished_at <= triaged.started_at
    # One drain, one reboot: the flow run found the node drained for its incident.
    assert sorted(a.action for a in detail.actions) == ["drain", "reboot", "resume"]
    assert [c for c in fleet.calls if c[0] == "gpu-node-3"][:2] == [
        ("gpu-node-3", "drain"),
        ("gpu-node-3", "reboot"),
    ]
    assert fleet.nodes["gpu-node-3"].boots == 1
    assert (record.action, fleet.nodes["gpu-node-3"].state) == ("reboot", NodeState.IDLE)


def test_an_action_a_human_must_approve_is_not_contained(
    store: Store, sim_backends: Backends, fleet: SimFleet, tmp_path: Path
) -> None:
    rt = with_policy(
        store, sim_backends, tmp_path, "required_for: [replace]", "required_for: [reboot, replace]"
    )
    incident = opened(rt, "gpu-node-2")
    assert contain(rt, incident.id, "gpu-node-2", "node") is None
    assert fleet.nodes["gpu-node-2"].state is NodeState.IDLE and fleet.calls == []
    detail = rt.store.incident_detail(incident.id)
    assert detail is not None and [d.action for d in detail.decisions] == ["reboot"]  # decided, recorded
    assert not [s for s in detail.steps if s.stage == "contain"]


def test_a_fault_the_policy_only_diagnoses_is_left_to_the_flow(runtime: Runtime, fleet: SimFleet) -> None:
    incident = opened(runtime, "gpu-node-4", code=13)  # a graphics engine exception: not a node action
    decision = contain(runtime, incident.id, "gpu-node-4", "node")
    assert decision is None and fleet.calls == []


def test_an_admins_drain_is_left_as_it_is(runtime: Runtime, fleet: SimFleet) -> None:
    node = fleet.nodes["gpu-node-5"]
    node.state, node.reason = NodeState.DRAINED, "admin: swapping a fan"
    incident = opened(runtime, "gpu-node-5")
    contain(runtime, incident.id, "gpu-node-5", "node")
    assert (node.state, node.reason) == (NodeState.DRAINED, "admin: swapping a fan")
    detail = runtime.store.incident_detail(incident.id)
    assert detail is not None
    (step,) = [s for s in detail.steps if s.stage == "contain"]
    assert "by others (admin: swapping a fan); left as is" in step.summary
    assert not detail.actions


def test_a_containment_waits_for_the_guardrail_slot_another_holder_has(
    runtime: Runtime, fleet: SimFleet
) -> None:
    """The slot is the Prefect server's: another process's action holds it as this one's would."""
    incident = opened(runtime, "gpu-node-6")
    done = threading.Event()
    with node_actions_slot(uuid.uuid4()):
        worker = threading.Thread(
            target=lambda: (contain(runtime, incident.id, "gpu-node-6", "node"), done.set()), daemon=True
        )
        worker.start()
        assert not done.wait(1.5)
        assert fleet.nodes["gpu-node-6"].state is NodeState.IDLE
    worker.join(30)
    assert done.is_set() and fleet.nodes["gpu-node-6"].state is NodeState.DRAINED


def test_a_guardrail_that_trips_at_the_last_check_stops_the_drain(
    store: Store, sim_backends: Backends, fleet: SimFleet, tmp_path: Path
) -> None:
    rt = with_policy(
        store, sim_backends, tmp_path, "never_touch: []", "never_touch: []\n  max_out_of_service: 1"
    )
    incident = opened(rt, "gpu-node-7")
    holder = uuid.uuid4()
    result: list[Any] = []
    with node_actions_slot(holder):
        worker = threading.Thread(
            target=lambda: result.append(contain(rt, incident.id, "gpu-node-7", "node")), daemon=True
        )
        worker.start()
        # Decided with room for one node out; while it waits for the slot, someone takes another out.
        until(lambda: rt.store.incident_detail(incident.id).decisions, "the decision")  # type: ignore[union-attr]
        other = fleet.nodes["gpu-node-1"]
        other.state, other.reason = NodeState.DOWN, "not responding"
    worker.join(30)
    assert result == [None] and fleet.nodes["gpu-node-7"].state is NodeState.IDLE
    detail = rt.store.incident_detail(incident.id)
    assert detail is not None
    (step,) = [s for s in detail.steps if s.stage == "contain"]
    assert step.status == StepStatus.SKIPPED and "max_out_of_service" in step.summary


def test_a_contained_node_comes_back_when_the_answer_changes_to_none(
    runtime: Runtime, fleet: SimFleet
) -> None:
    incident = opened(runtime, "gpu-node-8")
    decision = contain(runtime, incident.id, "gpu-node-8", "node")
    assert decision is not None and fleet.nodes["gpu-node-8"].state is NodeState.DRAINED
    left_alone = decision.model_copy(update={"action": Action.NONE})
    outcome = act.fn(incident.id, "gpu-node-8", None, left_alone)
    assert (outcome.status, outcome.detail) == (ActStatus.SKIPPED, "resumed gpu-node-8")
    assert fleet.nodes["gpu-node-8"].state is NodeState.IDLE


def test_a_drain_made_by_another_stage_is_not_returned_by_a_none(runtime: Runtime, fleet: SimFleet) -> None:
    """Only the containment's drain is undone: a diagnostic's answers for itself."""
    incident = opened(runtime, "gpu-node-1")
    node = fleet.nodes["gpu-node-1"]
    node.state, node.reason = NodeState.DRAINED, f"medic: diagnose incident {incident.id}"
    left_alone = evaluate(runtime, incident.id).model_copy(update={"action": Action.NONE})
    outcome = act.fn(incident.id, "gpu-node-1", None, left_alone)
    assert outcome.detail == "gpu-node-1 left alone" and node.state is NodeState.DRAINED


def untruthful_outcomes(store: Store) -> list[str]:
    """Incidents whose outcome says the node was not touched while the store holds a successful node
    action of theirs (issue 41): the record must say what we did and what we hold."""
    found = []
    for record in store.find_incidents():
        detail = store.incident_detail(record.id)
        acted = detail is not None and any(a.status == "succeeded" for a in detail.actions)
        if acted and "not touched" in (record.outcome or ""):
            found.append(f"{record.id}: {record.outcome}")
    return found


def test_a_node_contained_before_the_breaker_opened_is_held_for_people_and_said_so(
    runtime: Runtime, fleet: SimFleet
) -> None:
    """The kill storm's case: containment drained the node, then the breaker opened (other nodes' storm)
    and the run escalated. The outcome and the Slack thread say the node is drained and held by GPU
    Medic; it stays drained, listed as held for the incident."""
    incident = opened(runtime, "gpu-node-2")
    assert contain(runtime, incident.id, "gpu-node-2", "node") is not None
    runtime.store.open_breaker("3 nodes taken out within 5 minutes (a storm elsewhere)")

    outcome = asyncio.run(remediate(incident_id=incident.id, node="gpu-node-2"))

    assert outcome.act == ActStatus.ESCALATED
    record = runtime.store.get_incident(incident.id)
    assert record is not None and record.outcome is not None
    assert "guardrail circuit_breaker" in record.outcome, record.outcome
    assert "gpu-node-2 drained by GPU Medic and held for you" in record.outcome, record.outcome
    assert untruthful_outcomes(runtime.store) == []
    notifier = runtime.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    (thread,) = notifier.threads.values()
    assert any("drained by GPU Medic and held for you" in reply for reply in thread.replies), thread.replies
    assert fleet.nodes["gpu-node-2"].state is NodeState.DRAINED
    assert [(h.node, h.incident, h.action) for h in runtime.store.held_nodes()] == [
        ("gpu-node-2", incident.id, "drain")
    ]


def test_an_escalation_that_drained_nothing_says_the_node_was_not_touched(
    runtime: Runtime, fleet: SimFleet
) -> None:
    incident = opened(runtime, "gpu-node-4")
    runtime.store.open_breaker("a storm elsewhere")  # before containment: nothing is drained
    assert contain(runtime, incident.id, "gpu-node-4", "node") is None

    asyncio.run(remediate(incident_id=incident.id, node="gpu-node-4"))

    record = runtime.store.get_incident(incident.id)
    assert record is not None and "node not touched" in (record.outcome or ""), record
    assert fleet.nodes["gpu-node-4"].state is NodeState.IDLE and runtime.store.held_nodes() == []


def test_two_replicas_making_the_limit_at_once_both_have_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefect's upsert reads, then creates: two replicas starting together on a fresh API both
    find no limit and both create it, and the second is refused (409). That must not fail the
    first containment of the replica that lost the race."""

    async def race() -> None:
        async with get_client() as client:
            await client.delete_global_concurrency_limit_by_name(NODE_ACTIONS_LIMIT)
        monkeypatch.setattr(guard, "_ensured", set())
        ensured = [ensure_limits(), ensure_limits()]
        await asyncio.gather(*ensured)
        async with get_client() as client:
            made = await client.read_global_concurrency_limit_by_name(NODE_ACTIONS_LIMIT)
        assert made.limit == 1

    asyncio.run(race())
