"""`medic node held`: the nodes GPU Medic holds, from the store, with the scheduler's view of each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from factories import fault_event, incident
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.holds import Hold, InScheduler, in_scheduler
from medic.protocols import NodeInfo, NodeState
from medic.statuses import ActionStatus, IncidentStatus
from medic.store import Store, utcnow

runner = CliRunner()


@pytest.fixture
def held_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """gpu-node-3 drained by an incident handed to people; gpu-node-4 drained, rebooted and returned."""
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path))
    monkeypatch.setenv("MEDIC_DATABASE_URL", f"sqlite:///{tmp_path / 'medic.db'}")
    monkeypatch.setenv("COLUMNS", "400")
    store = Store(f"sqlite:///{tmp_path / 'medic.db'}")
    for node, actions, status in [
        ("gpu-node-3", ["drain"], IncidentStatus.ESCALATED),
        ("gpu-node-4", ["drain", "reboot", "resume"], IncidentStatus.CLOSED),
    ]:
        event = fault_event(node=node, id=f"{node}-e")
        store.record_accepted([event])
        store.open_incident(incident(event, id=f"inc-{node}"))
        for action in actions:
            store.claim_action(f"inc-{node}:{node}:{action}", f"inc-{node}", node, action)
            store.finish_action(f"inc-{node}:{node}:{action}", ActionStatus.SUCCEEDED, action)
        outcome = "handed to humans (reboot stopped by guardrail circuit_breaker); gpu-node-3 drained"
        store.update_incident(f"inc-{node}", status=status, closed_at=utcnow(), outcome=outcome)
    return store


def test_the_store_alone_lists_each_held_node_with_its_incident_and_why(held_store: Store) -> None:
    result = runner.invoke(app, ["node", "held", "--no-scheduler", "--json"])
    assert result.exit_code == 0, result.output
    (held,) = json.loads(result.stdout)
    assert (held["node"], held["incident"], held["action"]) == ("gpu-node-3", "inc-gpu-node-3", "drain")
    assert held["incident_status"] == "escalated" and "circuit_breaker" in held["outcome"]
    assert held["scheduler"] == "unknown"

    table = runner.invoke(app, ["node", "held", "--no-scheduler"])
    assert table.exit_code == 0 and "inc-gpu-node-3" in table.stdout and "gpu-node-4" not in table.stdout


def test_a_held_node_the_scheduler_shows_in_service_was_returned_by_someone_else(held_store: Store) -> None:
    # The simulated scheduler (MEDIC_BACKENDS=sim) starts with every node idle: someone returned it.
    result = runner.invoke(app, ["node", "held", "--json"])
    assert result.exit_code == 1, result.output
    (held,) = json.loads(result.stdout)
    assert held["scheduler"] == "returned by someone else"


def test_an_empty_store_holds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path))
    monkeypatch.setenv("MEDIC_DATABASE_URL", f"sqlite:///{tmp_path / 'empty.db'}")
    result = runner.invoke(app, ["node", "held"])
    assert result.exit_code == 0 and "holds no node" in result.stdout


@pytest.mark.parametrize(
    ("state", "reason", "expected"),
    [
        (NodeState.DRAINED, "medic: reboot incident inc-1", InScheduler.HELD),
        (NodeState.DRAINED, "medic: reboot incident inc-2", InScheduler.OURS_OTHER),
        (NodeState.IDLE, None, InScheduler.RETURNED),
        (NodeState.DOWN, "admin: PSU swap", InScheduler.TAKEN),
    ],
)
def test_what_the_scheduler_says_of_a_hold(
    state: NodeState, reason: str | None, expected: InScheduler
) -> None:
    hold = Hold(node="n", incident="inc-1", action="drain", since=utcnow())
    named = reason.rsplit(" ", 1)[-1] if reason and reason.startswith("medic:") else None
    assert in_scheduler(hold, NodeInfo("n", state, reason), named) is expected
    assert in_scheduler(hold, None, None) is InScheduler.UNKNOWN
