"""Who may return a node to service: the incident that drained it, or a later one once that incident is
no longer active (closed, escalated, failed); never while another incident still works on it. The live
path (Prefect test harness, simulated fleet) and `medic triage` of a recorded stream agree: a node we
took out, however long ago, that then passes its diagnostic is reintegrated.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from checkout import REPO_ROOT
from factories import event_line, fault_event, incident
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.events import FaultEvent
from medic.flows.dispatch import Dispatch, remediate_all
from medic.flows.remediate import Outcome
from medic.intake import read_lines
from medic.integrations.sim.fleet import SimFleet
from medic.policy import Action, load_policy
from medic.protocols import NodeState
from medic.statuses import IncidentStatus
from medic.tasks.nodes.service import drain_incident, drain_reason, resume_node
from medic.tasks.runtime.process import Runtime
from medic.tasks.verify import verify
from medic.triage import triage

pytestmark = pytest.mark.usefixtures("prefect_harness")

NODE = "gpu-node-5"
T0 = datetime.now(UTC) - timedelta(minutes=5)
ACTIVE = [IncidentStatus.OPEN, IncidentStatus.REMEDIATING, IncidentStatus.WAITING_FOR_APPROVAL]
PAST = [IncidentStatus.CLOSED, IncidentStatus.ESCALATED, IncidentStatus.FAILED]


def passed_diagnostic(event_id: str = "diag-pass") -> str:
    event = fault_event(
        "diagnostic", id=event_id, node=NODE, at=T0, attributes={"level": 1, "result": "pass"}
    )
    return event.model_dump_json()


def run(rt: Runtime, lines: list[str]) -> Outcome:
    dispatch: Dispatch = asyncio.run(remediate_all(rt, read_lines(lines, "ownership.jsonl")))
    assert not dispatch.failed, dispatch.failed
    (outcome,) = dispatch.outcomes
    return outcome


def recorded_incident(rt: Runtime, incident_id: str, status: str, **fields: Any) -> None:
    """An incident of ours in the store, as an earlier run left it."""
    first = fault_event(id=f"{incident_id}-ev", node=fields.get("node", NODE), at=T0 - timedelta(days=2))
    rt.store.open_incident(incident(first, id=incident_id, **fields))
    rt.store.update_incident(incident_id, status=status)


def drained_for(rt: Runtime, incident_id: str, why: str = "DCGM level 2") -> str:
    reason = drain_reason(incident_id, why)
    rt.backends.scheduler.drain(NODE, reason)
    return reason


def calls(fleet: SimFleet) -> list[str]:
    return [action for target, action in fleet.calls if target == NODE]


def test_the_incident_is_read_from_our_drain_reason() -> None:
    assert drain_incident(drain_reason("inc-0a1b2c3d4e", "DCGM level 2")) == "inc-0a1b2c3d4e"
    # Slurm appends to a reason across a reboot; the incident is still ours to read.
    assert drain_incident("medic: reboot incident inc-0a1b2c3d4e : reboot issued") == "inc-0a1b2c3d4e"
    assert drain_incident("medic: earlier incident") is None
    assert drain_incident(None) is None


@pytest.mark.parametrize("status", PAST)
def test_a_node_a_past_incident_of_ours_drained_is_reintegrated_once_it_passes(
    runtime: Runtime, fleet: SimFleet, status: str
) -> None:
    recorded_incident(runtime, "inc-past", status)
    drained_for(runtime, "inc-past")

    outcome = run(runtime, [passed_diagnostic()])

    assert (outcome.action, outcome.rule, outcome.act) == ("reintegrate", "diag-pass-reintegrate", "done")
    assert fleet.nodes[NODE].state is NodeState.IDLE and fleet.nodes[NODE].reason is None
    detail = runtime.store.incident_detail(outcome.incident)
    assert detail is not None
    assert [(a.action, a.status) for a in detail.actions] == [("resume", "succeeded")]


@pytest.mark.parametrize("status", ACTIVE)
def test_a_node_another_active_incident_drained_is_never_resumed(
    runtime: Runtime, fleet: SimFleet, status: str
) -> None:
    # A switch-wide incident still being handled holds the node (one active incident per node
    # otherwise: the new event would join it).
    recorded_incident(runtime, "inc-holder", status, node="leaf-2", scope="switch")
    reason = drained_for(runtime, "inc-holder", "reboot awaiting approval")

    outcome = run(runtime, [passed_diagnostic()])

    assert (outcome.action, outcome.act) == ("reintegrate", "done")
    assert f"{NODE} not resumed: drained for incident inc-holder, which is still {status}" in outcome.summary
    assert (fleet.nodes[NODE].state, fleet.nodes[NODE].reason) == (NodeState.DRAINED, reason)
    assert "resume" not in calls(fleet)
    detail = runtime.store.incident_detail(outcome.incident)
    assert detail is not None and detail.actions == []


def test_verification_never_resumes_a_node_another_active_incident_holds(
    runtime: Runtime, fleet: SimFleet
) -> None:
    recorded_incident(runtime, "inc-holder", IncidentStatus.REMEDIATING, node="leaf-2", scope="switch")
    recorded_incident(runtime, "inc-ours", IncidentStatus.REMEDIATING)
    drained_for(runtime, "inc-holder")

    outcome = verify.fn("inc-ours", NODE, 1, Action.REBOOT, ready_timeout_s=1)

    assert outcome.passed and "not resumed: drained for incident inc-holder" in outcome.detail
    assert fleet.nodes[NODE].state is NodeState.DRAINED and "resume" not in calls(fleet)


def test_verification_resumes_the_node_its_own_incident_drained(runtime: Runtime, fleet: SimFleet) -> None:
    recorded_incident(runtime, "inc-ours", IncidentStatus.REMEDIATING)
    drained_for(runtime, "inc-ours", "reboot")

    outcome = verify.fn("inc-ours", NODE, 1, Action.REBOOT, ready_timeout_s=1)

    assert outcome.passed and outcome.detail.endswith(f"resumed {NODE}")
    assert fleet.nodes[NODE].state is NodeState.IDLE


def test_a_drain_naming_an_incident_this_store_does_not_know_is_left_alone(
    runtime: Runtime, fleet: SimFleet
) -> None:
    drained_for(runtime, "inc-elsewhere")
    assert "which this store does not know" in resume_node(runtime, "inc-ours", NODE)
    assert fleet.nodes[NODE].state is NodeState.DRAINED
    # A "medic:" reason that names no incident is ours all the same (written by hand, or before ids).
    runtime.backends.scheduler.drain(NODE, "medic: drained by hand")
    assert resume_node(runtime, "inc-ours", NODE) == f"resumed {NODE}"


# --- `medic triage` of a recorded stream ----------------------------------------------------------

DEFAULT_POLICY = load_policy(REPO_ROOT / "policies" / "default.yaml")
T1 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def remediation(action: str, minutes: float, source: str = "medic") -> FaultEvent:
    return fault_event(
        "remediation", id=f"r-{action}-{minutes}", at=T1, minutes=minutes, source=source, action=action
    )


def diagnostic_pass(minutes: float) -> FaultEvent:
    return fault_event(
        "diagnostic",
        id=f"d-{minutes}",
        at=T1,
        minutes=minutes,
        source="medic",
        attributes={"level": 2, "result": "pass"},
    )


def replayed(*events: FaultEvent) -> tuple[str, str]:
    ((_, decision),) = list(triage(events, DEFAULT_POLICY))
    return decision.action.value, decision.rule


@pytest.mark.parametrize("action", ["drain", "reboot", "reset_gpu", "replace"])
def test_triage_reintegrates_a_node_we_took_out_that_then_passes(action: str) -> None:
    # Two days apart: however long ago we took it out, a pass brings it back.
    assert replayed(remediation(action, 0), diagnostic_pass(2 * 24 * 60)) == (
        "reintegrate",
        "diag-pass-reintegrate",
    )


@pytest.mark.parametrize(
    "history",
    [
        [remediation("drain", 0, source="slurm")],  # someone else's drain: never ours to return
        [remediation("drain", 0), remediation("resume", 5)],  # returned already
        [remediation("drain", 0), remediation("drain", 5, source="admin")],  # theirs now
    ],
)
def test_triage_leaves_a_node_we_do_not_hold_as_it_is(history: list[FaultEvent]) -> None:
    assert replayed(*history, diagnostic_pass(60)) == ("none", "diag-pass")


def test_medic_triage_command_reintegrates_a_recorded_drain_of_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path / "home"))
    stream = tmp_path / "recorded.jsonl"
    lines = [
        event_line("remediation", id="r1", at=T1, source="medic", action="drain"),
        event_line(
            "diagnostic",
            id="d1",
            at=T1,
            minutes=30,
            source="medic",
            attributes={"level": 2, "result": "pass"},
        ),
    ]
    stream.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    result = CliRunner().invoke(
        app, ["triage", str(stream), "--json", "--policy", str(REPO_ROOT / "policies" / "default.yaml")]
    )
    assert result.exit_code == 0, result.output
    (decided,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert (decided["action"], decided["rule"]) == ("reintegrate", "diag-pass-reintegrate")
