"""Every move that takes a node out of service passes the guardrails under the one slot
(docs/decisions/0007): the drain before a DCGM level 2-4 run, the drain while an approval is
awaited, a plain drain, a destructive action. Nodes out of service for any reason count toward
`max_out_of_service` unless the policy says `count_out_of_service_by_others: false`."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from checkout import REPO_ROOT
from factories import fault_event
from prefect import flow

from medic.flows.dispatch import record, remediate_all
from medic.flows.remediate import Outcome, remediate
from medic.intake import read_lines
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.sim.notifier import RecordingNotifier
from medic.policy import Action, Decision
from medic.policy.guardrails import check
from medic.policy.model import Classification
from medic.protocols import Message, NodeState
from medic.store import utcnow
from medic.tasks import diagnose as diagnose_task
from medic.tasks.nodes import guard as guard_task
from medic.tasks.nodes.evidence import fleet_state
from medic.tasks.nodes.guard import guarded
from medic.tasks.nodes.service import OutsideGuardrailSlotError, ensure_drained, take_out_of_service
from medic.tasks.runtime.process import Runtime

pytestmark = pytest.mark.usefixtures("prefect_harness")

ADMIN = "admin: RMA 4711, do not touch"
OUT = (NodeState.DRAINED, NodeState.DOWN, NodeState.REBOOTING)


def straggling(node: str) -> list[str]:
    at = datetime.now(UTC) - timedelta(minutes=2)
    return [
        fault_event(
            "straggler",
            id=f"slow-{node}-{i}",
            node=node,
            at=at,
            seconds=i * 10,
            attributes={"step_time_ratio": 1.4},
        ).model_dump_json()
        for i in range(3)
    ]


def xid79(node: str) -> list[str]:
    return [fault_event(id=f"x79-{node}", node=node, at=datetime.now(UTC)).model_dump_json()]


def node_calls(fleet: SimFleet, node: str) -> list[str]:
    return [action for target, action in fleet.calls if target == node]


@pytest.fixture
def policy_file(runtime: Runtime, tmp_path: Path) -> Callable[[str, str], None]:
    """Edit a copy of the default policy in place: `edit(old, new)`."""
    path = tmp_path / "policy.yaml"
    shutil.copy(REPO_ROOT / "policies" / "default.yaml", path)
    runtime.policy_path = path

    def edit(old: str, new: str) -> None:
        text = path.read_text()
        assert old in text, old
        path.write_text(text.replace(old, new, 1))

    return edit


# The default policy's approvals, edited: reboots wait for U0ALICE, whose answer never comes in 3 s.
ASK_BEFORE_REBOOT = (
    "  required_for: [replace]\n  approvers: []\n  timeout_minutes: 60\n",
    "  required_for: [reboot]\n  approvers: [U0ALICE]\n  timeout_minutes: 0.05\n",
)


def admin_drains_on_first_post(runtime: Runtime, monkeypatch: pytest.MonkeyPatch, node: str) -> None:
    """An admin takes `node` out just after the incident's message goes out: after the decision,
    before the drain. Only the last check, under the slot, can see it."""
    notifier = runtime.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    post = notifier.post

    def post_then_drain(message: Message) -> str:
        ref = post(message)
        if len(notifier.threads) == 1:
            runtime.backends.scheduler.drain(node, ADMIN)
        return ref

    monkeypatch.setattr(notifier, "post", post_then_drain)


def run(rt: Runtime, lines: list[str]) -> list[Outcome]:
    return asyncio.run(remediate_all(rt, read_lines(lines, "t.jsonl"))).outcomes


# --- (a) the drain before a level 2 diagnostic ----------------------------------------------


def test_a_level_2_drain_refused_at_the_last_check_runs_nothing_and_escalates(
    runtime: Runtime, fleet: SimFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Default policy: 10% of 8 nodes, so one node may be out. gpu-node-5 goes out meanwhile.
    admin_drains_on_first_post(runtime, monkeypatch, "gpu-node-5")
    (outcome,) = run(runtime, straggling("gpu-node-2"))

    assert outcome.action == "escalate"
    assert outcome.diagnostics == ["L2 not run (guardrail max_out_of_service)"]
    assert "diagnose stopped by guardrail max_out_of_service at the last check" in outcome.reason
    assert "max_out_of_service" in outcome.summary
    # Not drained, no DCGM run: the node is as it was.
    assert node_calls(fleet, "gpu-node-2") == []
    assert fleet.nodes["gpu-node-2"].state is NodeState.IDLE
    detail = runtime.store.incident_detail(outcome.incident)
    assert detail is not None and detail.incident.status == "escalated"
    last = detail.decisions[-1]
    assert (last.action, last.guardrail, last.blocked_action) == (
        "escalate",
        "max_out_of_service",
        "diagnose",
    )
    assert detail.diagnostics == [] and not [a for a in detail.actions if a.action == "drain"]
    (step,) = [s for s in detail.steps if s.stage == "diagnose L2"]
    assert step.status == "skipped" and "max_out_of_service" in step.summary


# --- (b) the drain while an approval is awaited ---------------------------------------------


def test_an_approval_wait_does_not_drain_past_the_limit(
    runtime: Runtime,
    fleet: SimFleet,
    policy_file: Callable[[str, str], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MEDIC_APPROVAL_POLL_SECONDS", "1")
    policy_file(*ASK_BEFORE_REBOOT)
    admin_drains_on_first_post(runtime, monkeypatch, "gpu-node-5")
    (outcome,) = run(runtime, xid79("gpu-node-1"))

    assert outcome.action == "escalate" and "no answer within" in outcome.reason
    # The suspect node stayed in service while the humans were asked, and they were told why.
    assert "drain" not in node_calls(fleet, "gpu-node-1") and fleet.nodes["gpu-node-1"].boots == 0
    assert fleet.nodes["gpu-node-1"].state is NodeState.IDLE
    notifier = runtime.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    (ask,) = [t.message for t in notifier.threads.values() if t.message.title.startswith("Approval needed")]
    assert (
        "gpu-node-1 is kept in service while you decide: drain stopped by guardrail max_out_of_service"
        in (ask.body)
    )
    detail = runtime.store.incident_detail(outcome.incident)
    assert detail is not None
    (step,) = [s for s in detail.steps if s.stage == "approval"]
    assert step.detail is not None and "max_out_of_service" in step.detail["drain"]


def test_an_approval_wait_with_room_drains_under_the_slot(
    runtime: Runtime,
    fleet: SimFleet,
    policy_file: Callable[[str, str], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MEDIC_APPROVAL_POLL_SECONDS", "1")
    policy_file(*ASK_BEFORE_REBOOT)
    acquired = count_acquisitions(monkeypatch)
    run(runtime, xid79("gpu-node-1"))
    assert node_calls(fleet, "gpu-node-1") == ["drain"]  # kept off work while waiting, then escalated
    assert fleet.nodes["gpu-node-1"].state is NodeState.DRAINED
    assert acquired == [1]  # the drain took the slot; the escalation takes nothing out


# --- (c) nodes out for any reason count, unless the policy says otherwise --------------------


def _reboot(node: str) -> Decision:
    return Decision(
        incident=f"inc-{node}",
        classification=Classification.HARDWARE,
        action=Action.REBOOT,
        rule="r",
        reason="-",
    )


def test_nodes_an_admin_drained_count_by_default_and_not_with_the_option_off(
    runtime: Runtime, fleet: SimFleet, policy_file: Callable[[str, str], None]
) -> None:
    runtime.backends.scheduler.drain("gpu-node-5", ADMIN)
    fleet.nodes["gpu-node-6"].state = NodeState.DOWN  # Slurm marked it down: not responding
    fleet.nodes["gpu-node-6"].reason = "Not responding"
    policy_file("max_out_of_service_percent: 10", "max_out_of_service: 2")

    policy = runtime.policy().policy
    assert policy.guardrails.count_out_of_service_by_others is True  # the default, and the shipped policy's
    state = fleet_state(runtime, policy, utcnow(), runtime.backends.scheduler.nodes())
    assert state.out_of_service == {"gpu-node-5", "gpu-node-6"}
    assert check(policy.guardrails, state, "gpu-node-1", _reboot("gpu-node-1")) == (
        "max_out_of_service",
        "2 nodes already out of service (limit 2)",
    )

    policy_file("count_out_of_service_by_others: true", "count_out_of_service_by_others: false")
    policy = runtime.policy().policy
    assert policy.guardrails.count_out_of_service_by_others is False
    state = fleet_state(runtime, policy, utcnow(), runtime.backends.scheduler.nodes())
    assert state.out_of_service == frozenset()
    assert check(policy.guardrails, state, "gpu-node-1", _reboot("gpu-node-1")) is None


def test_with_the_option_off_an_admin_drain_does_not_hold_back_a_level_2_run(
    runtime: Runtime,
    fleet: SimFleet,
    policy_file: Callable[[str, str], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy_file("count_out_of_service_by_others: true", "count_out_of_service_by_others: false")
    admin_drains_on_first_post(runtime, monkeypatch, "gpu-node-5")
    (outcome,) = run(runtime, straggling("gpu-node-2"))
    assert outcome.diagnostics == ["L2 pass"]
    assert node_calls(fleet, "gpu-node-2")[:2] == ["drain", "diagnose-l2"]


def test_a_node_rebooting_counts_as_out(runtime: Runtime, fleet: SimFleet) -> None:
    fleet.nodes["gpu-node-7"].state = NodeState.REBOOTING
    policy = runtime.policy().policy
    state = fleet_state(runtime, policy, utcnow(), runtime.backends.scheduler.nodes())
    assert state.out_of_service == {"gpu-node-7"}


# --- one slot per transition ----------------------------------------------------------------


def count_acquisitions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    acquired = [0]
    real = guard_task.acquire

    def counting(*args: Any, **kwargs: Any) -> Any:
        acquired[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(guard_task, "acquire", counting)
    return acquired


def test_nothing_drains_outside_the_slot(runtime: Runtime) -> None:
    with pytest.raises(OutsideGuardrailSlotError):
        ensure_drained(runtime, "inc-x", "gpu-node-1", "a shortcut")
    assert runtime.backends.scheduler.node("gpu-node-1").state is NodeState.IDLE


def test_a_destructive_action_takes_the_slot_once_for_its_drain_and_call(
    runtime: Runtime, fleet: SimFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    acquired = count_acquisitions(monkeypatch)
    (outcome,) = run(runtime, xid79("gpu-node-3"))
    assert (outcome.action, outcome.act) == ("reboot", "done")
    assert node_calls(fleet, "gpu-node-3")[:2] == ["drain", "reboot"]
    assert acquired == [1]


def test_a_drain_inside_a_guarded_block_does_not_take_the_slot_again(
    runtime: Runtime, fleet: SimFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    acquired = count_acquisitions(monkeypatch)

    @flow(name="nested-guard", persist_result=False)
    def nested() -> str:
        with guarded(runtime, "gpu-node-4", _reboot("gpu-node-4")) as stopped:
            assert stopped is None
            drain = _reboot("gpu-node-4").model_copy(update={"action": Action.DRAIN})
            return take_out_of_service(runtime, "inc-gpu-node-4", "gpu-node-4", drain, "nested").detail

    assert nested() == "drained gpu-node-4"  # with a second acquisition it would wait on itself
    assert acquired == [1]


# --- (d) concurrent incidents never exceed the limit ----------------------------------------


def test_concurrent_level_2_diagnostics_never_exceed_max_out_of_service(
    runtime: Runtime,
    fleet: SimFleet,
    policy_file: Callable[[str, str], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy_file("max_out_of_service_percent: 10", "max_out_of_service: 2")
    policy_file("nodes_percent: 25", "nodes_percent: 100")  # the breaker is not what this test is about
    nodes = ["gpu-node-1", "gpu-node-2", "gpu-node-5", "gpu-node-6"]
    # The worst interleaving, forced: every incident has decided "diagnose at level 2" (no node out
    # yet) before any drains; then all drain at once. Each drained node stays out until all four
    # have had their answer, so a late check cannot slip in after an early node came back.
    decided = threading.Barrier(len(nodes), timeout=120)
    answered: set[str] = set()
    all_answered = threading.Condition()
    real_take = diagnose_task.take_out_of_service

    def take_after_all_decided(rt: Runtime, incident_id: str, node: str, intent: Decision, why: str) -> Any:
        decided.wait()
        try:
            return real_take(rt, incident_id, node, intent, why)
        finally:
            with all_answered:
                answered.add(node)
                all_answered.notify_all()

    monkeypatch.setattr(diagnose_task, "take_out_of_service", take_after_all_decided)
    diagnostics = runtime.backends.diagnostics
    real_run = diagnostics.run

    def held_until_all_answered(node: str, level: int, timeout_s: float) -> Any:
        if level >= 2:
            with all_answered:
                assert all_answered.wait_for(lambda: len(answered) == len(nodes), timeout=120)
        return real_run(node, level, timeout_s=timeout_s)

    monkeypatch.setattr(diagnostics, "run", held_until_all_answered)
    dispatch = record(runtime, read_lines([ln for n in nodes for ln in straggling(n)], "t.jsonl"))
    assert sorted(i.node for i in dispatch.incidents) == nodes

    most, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            with fleet.lock:
                out = sum(1 for n in fleet.nodes.values() if n.state in OUT)
            most[0] = max(most[0], out)
            time.sleep(0.002)

    outcomes: dict[str, Outcome] = {}
    errors: list[BaseException] = []

    def one(incident_id: str, node: str) -> None:
        try:
            outcomes[node] = asyncio.run(remediate(incident_id=incident_id, node=node))
        except BaseException as error:  # surfaced below
            errors.append(error)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    runs = [threading.Thread(target=one, args=(i.id, i.node), daemon=True) for i in dispatch.incidents]
    for t in runs:
        t.start()
    for t in runs:
        t.join(timeout=240)
    done.set()
    sampler.join(5)

    assert not errors, errors
    assert len(outcomes) == len(nodes)
    assert most[0] <= 2, f"{most[0]} nodes out at once (limit 2)"
    ran = [n for n, o in outcomes.items() if o.diagnostics == ["L2 pass"]]
    held = [n for n, o in outcomes.items() if o.action == "escalate"]
    assert sorted(ran + held) == nodes
    assert ran and held, {n: (o.action, o.diagnostics, o.reason) for n, o in outcomes.items()}
    assert all("max_out_of_service" in outcomes[n].reason for n in held)
    for n in held:  # never drained, never diagnosed at level 2
        assert not {"drain", "diagnose-l2"} & set(node_calls(fleet, n)), node_calls(fleet, n)
    assert most[0] == 2  # they did overlap: the limit, not luck, kept the rest in
