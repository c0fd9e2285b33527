"""Sweeps: the plan (pure), and the flow over the simulated fleet (docs/sweeps.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from checkout import REPO_ROOT

from medic.ageing import FleetHealth, PastIncident, Reading, assess
from medic.events import FaultEvent
from medic.flows.sweep import sweep
from medic.integrations.registry import Backends
from medic.integrations.sim.fleet import SimFleet
from medic.policy.guardrails import FleetState
from medic.policy.model import CircuitBreaker, Guardrails
from medic.protocols import DiagnosticResult, Diagnostics, NodeInfo, NodeState
from medic.store import Store
from medic.store.tables import DiagnosticRecord
from medic.sweep import NodeBusyError, SweepSettings, plan
from medic.tasks.runtime.process import Runtime, configure
from medic.tasks.sweep import NoReservationsError, make_plan, reservation_minutes

NOW = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)
FREE = Guardrails()


# A failing DCGM run takes the node out: what remediation does with it is the policy's business, and
# the default policy's `replace` waits for a human.
POLICY = """\
version: 1
guardrails: {max_out_of_service: 3}
rules:
  - id: diag-fail-drain
    description: A DCGM diagnostic failed; keep jobs off the node
    when:
      diagnostic: {result: fail}
    then: {classification: hardware, action: drain}
"""


@pytest.fixture
def runtime(sqlite_store: Store, sim_backends: Backends, tmp_path: Path) -> Runtime:
    """One database is enough here: the store's queries are the ones `medic fleet health` runs."""
    policy = tmp_path / "sweep.yaml"
    policy.write_text(POLICY)
    return configure(Runtime(sqlite_store, sim_backends, policy))


def idle(*names: str) -> list[NodeInfo]:
    return [NodeInfo(n, NodeState.IDLE) for n in names]


def health(incidents: Sequence[PastIncident] = (), readings: Sequence[Reading] = ()) -> FleetHealth:
    return assess(incidents, readings, NOW - 30 * DAY, NOW)


def ecc_rising(node: str, gpu: int = 3) -> list[Reading]:
    """Corrected ECC errors climbing 50 a day for four days: evidence of wear."""
    return [Reading(node, gpu, NOW - (4 - d) * DAY, {"ecc_corrected": 100 + 50 * d}) for d in range(5)]


def test_risk_first_then_the_stalest_never_checked_counting_as_stalest() -> None:
    nodes = idle("n1", "n2", "n3", "n4")
    last = {"n1": NOW - 30 * DAY, "n2": NOW - 8 * DAY, "n4": NOW - 10 * DAY}
    planned = plan(
        nodes, health(readings=ecc_rising("n4")), last, FREE, FleetState(NOW), SweepSettings(max_nodes=4)
    )
    assert [p.node for p in planned.picks] == ["n4", "n3", "n1", "n2"]
    risky = planned.picks[0]
    assert risky.score > 0 and risky.last_check == last["n4"]
    assert risky.reasons[0].startswith("ageing score")
    assert any("ecc_corrected rising 50/day" in r for r in risky.reasons)
    assert planned.picks[1].reasons == ["never deep-checked"]
    assert planned.picks[2].reasons == ["last deep check 30.0 days ago (stale after 7.0 days)"]


def test_a_recent_check_is_not_due_unless_the_node_is_at_risk() -> None:
    nodes = idle("calm", "ageing", "fresh")
    last = {"calm": NOW - 2 * DAY, "ageing": NOW - 2 * DAY, "fresh": NOW - timedelta(hours=3)}
    readings = ecc_rising("ageing") + ecc_rising("fresh")
    planned = plan(nodes, health(readings=readings), last, FREE, FleetState(NOW), SweepSettings())
    assert [p.node for p in planned.picks] == ["ageing"]
    assert "at risk, due again after 24 h" in planned.picks[0].reasons[-1]
    skipped = {s.node: s.why for s in planned.skipped}
    assert skipped == {"calm": "deep-checked 2.0 days ago", "fresh": "deep-checked 3 h ago"}


def test_only_idle_nodes_unreserved_are_candidates() -> None:
    nodes = [
        NodeInfo("busy", NodeState.ALLOCATED),
        NodeInfo("drained", NodeState.DRAINED, "admin: cabling"),
        NodeInfo("held", NodeState.IDLE),
        NodeInfo("free", NodeState.IDLE),
    ]
    planned = plan(nodes, health(), {}, FREE, FleetState(NOW), SweepSettings(), reserved=frozenset({"held"}))
    assert [p.node for p in planned.picks] == ["free"]
    assert {s.node: s.why for s in planned.skipped} == {
        "busy": "allocated: not idle, a job may run on it",
        "drained": "drained: already out of service (admin: cabling)",
        "held": "held by a sweep's reservation",
    }


def test_the_guardrails_cap_the_picks_counting_nodes_already_out() -> None:
    nodes = [NodeInfo("out", NodeState.DRAINED, "admin"), *idle("a", "b", "c", "d")]
    rails = Guardrails(max_out_of_service=3, never_touch=["d"])
    state = FleetState(NOW, fleet_size=5, out_of_service=frozenset({"out"}))
    planned = plan(nodes, health(), {}, rails, state, SweepSettings(max_nodes=10))
    assert [p.node for p in planned.picks] == ["a", "b"]  # "out" plus two: the limit of 3
    skipped = {s.node: s.why for s in planned.skipped}
    assert skipped["c"] == "due, but guardrail max_out_of_service: 3 nodes already out of service (limit 3)"
    assert skipped["d"] == "due, but guardrail never_touch: d is on the never-touch list"


def test_the_breaker_counts_each_pick_as_taken_out() -> None:
    rails = Guardrails(circuit_breaker=CircuitBreaker(window_minutes=5, nodes_at_least=2))
    planned = plan(
        idle("a", "b", "c"), health(), {}, rails, FleetState(NOW, fleet_size=3), SweepSettings(max_nodes=3)
    )
    assert [p.node for p in planned.picks] == ["a", "b"]
    assert "circuit_breaker" in next(s.why for s in planned.skipped if s.node == "c")


def test_the_sweeps_own_maximum() -> None:
    planned = plan(idle("a", "b", "c"), health(), {}, FREE, FleetState(NOW), SweepSettings(max_nodes=1))
    assert [p.node for p in planned.picks] == ["a"]
    assert {s.why for s in planned.skipped} == {"due, but this sweep checks 1 at most"}


def test_the_reservation_outlasts_the_levels_budget() -> None:
    assert reservation_minutes(SweepSettings(level=2, reservation_minutes=30)) == 30
    assert reservation_minutes(SweepSettings(level=4, reservation_minutes=30)) == 155


def test_settings_are_checked_at_the_boundary() -> None:
    with pytest.raises(ValueError, match="level"):
        SweepSettings(level=5)
    with pytest.raises(ValueError, match="max_nodes"):
        SweepSettings(max_nodes=0)


# --- over the simulated fleet -------------------------------------------------------------------

flowing = pytest.mark.usefixtures("prefect_harness")


def test_sim_reservations_refuse_a_busy_node_and_keep_requeues_off(
    fleet: SimFleet, sim_backends: Backends
) -> None:
    held = sim_backends.reservations
    assert held is not None
    fleet.add_job("j1", "alice", ["gpu-node-1"])
    fleet.nodes["gpu-node-1"].state = NodeState.ALLOCATED
    with pytest.raises(NodeBusyError, match="gpu-node-1"):
        held.reserve(["gpu-node-1"], 30, "test")
    name = held.reserve(["gpu-node-2"], 30, "test")
    assert held.reserved_nodes() == {"gpu-node-2"}
    held.release(name)
    held.release(name)  # already gone: no error
    assert held.reserved_nodes() == frozenset()


def test_no_reservations_no_sweep(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(runtime.backends), "reservations", property(lambda self: None))
    with pytest.raises(NoReservationsError, match="nothing is swept"):
        make_plan(runtime, SweepSettings())


def test_plan_reads_last_checks_and_ageing_from_the_store(runtime: Runtime) -> None:
    _age_the_fleet(runtime, "gpu-node-5", checked=timedelta(hours=1))
    assert make_plan(runtime, SweepSettings(at_risk_after_hours=24)).picks == []
    (pick,) = make_plan(runtime, SweepSettings(at_risk_after_hours=0.5)).picks
    assert pick.node == "gpu-node-5" and pick.score > 0


def _age_the_fleet(runtime: Runtime, degrading: str, checked: timedelta = 2 * DAY) -> None:
    """Every node deep-checked `checked` ago; one GPU's corrected ECC errors climbing for days."""
    now = datetime.now(UTC)
    for i in range(1, 9):
        at = now - checked
        runtime.store.add_diagnostic(
            DiagnosticRecord(
                incident_id="x", node=f"gpu-node-{i}", level=2, result="pass", started_at=at, finished_at=at
            )
        )
    runtime.store.record_history(
        FaultEvent(
            id=f"ecc-{d}",
            time=now - timedelta(days=4 - d, hours=2),
            source="agent",
            kind="ecc",
            node=degrading,
            gpu=3,
            attributes={"sbe": 1, "counters": {"ecc_corrected": 100 + 80 * d}},
        )
        for d in range(5)
    )


@flowing
def test_the_sweep_finds_the_degrading_gpu_and_hands_it_to_remediation(
    runtime: Runtime, fleet: SimFleet
) -> None:
    degrading = "gpu-node-5"
    _age_the_fleet(runtime, degrading)
    fleet.script_diagnostic(degrading, 2, "fail", ("DCGM_FR_FAULTY_MEMORY",))
    report = asyncio.run(sweep(SweepSettings(max_nodes=2)))

    assert [n.node for n in report.nodes] == [degrading]  # the others are not due
    (swept,) = report.nodes
    assert (swept.result, swept.error_ids) == ("fail", ["DCGM_FR_FAULTY_MEMORY"])
    assert fleet.reservations == {}  # released
    calls = [c for c in fleet.calls if c[0] == degrading]
    assert calls[:3] == [(degrading, "reserve"), (degrading, "diagnose-l2"), (degrading, "release")]
    (handed,) = report.handed_on
    assert handed.node == degrading
    assert handed.action == "drain"
    assert fleet.nodes[degrading].state is NodeState.DRAINED  # before any job lands on it
    events = runtime.store.incident_events(handed.incident)
    assert next((e.kind, e.source, e.attributes["result"]) for e in events) == (
        "diagnostic",
        "medic-sweep",
        "fail",
    )
    (step,) = runtime.store.steps_of(report.sweep)
    assert (step.stage, step.status) == ("sweep L2", "ok")
    assert (
        step.summary == f"DCGM level 2 fail (DCGM_FR_FAULTY_MEMORY); reservation {swept.reservation} released"
    )
    assert [d.detail for d in runtime.store.diagnostics_of(report.sweep)] == [
        "sweep: simulated DCGM level 2: fail (DCGM_FR_FAULTY_MEMORY)"
    ]


class ExplodingOn:
    """DCGM that raises on one node and is the simulation's on the others."""

    def __init__(self, node: str, others: Diagnostics) -> None:
        self.node, self.others = node, others

    def run(self, node: str, level: int, timeout_s: float) -> DiagnosticResult:
        if node == self.node:
            raise RuntimeError("dcgmi fell over")
        return self.others.run(node, level, timeout_s)


@flowing
def test_a_diagnostic_that_raises_still_releases_and_the_other_failures_are_handed_on(
    runtime: Runtime, fleet: SimFleet
) -> None:
    runtime.backends.diagnostics = ExplodingOn("gpu-node-1", runtime.backends.diagnostics)
    fleet.script_diagnostic("gpu-node-2", 2, "fail", ("DCGM_FR_FAULTY_MEMORY",))
    with pytest.raises(RuntimeError, match="dcgmi fell over"):
        asyncio.run(sweep(SweepSettings(max_nodes=2)))
    assert fleet.reservations == {}
    assert [c[1] for c in fleet.calls].count("release") == 2
    (handed,) = runtime.store.find_incidents(node="gpu-node-2")
    assert handed.action == "drain"


def test_the_deployment_runs_the_flow_nightly_with_the_documented_defaults() -> None:
    from prefect.flows import load_flow_from_entrypoint

    file = yaml.safe_load((REPO_ROOT / "deployments" / "prefect.yaml").read_text())
    (deployment,) = [d for d in file["deployments"] if d["name"] == "sweep"]
    flow = load_flow_from_entrypoint(deployment["entrypoint"])
    parameters = flow.validate_parameters(deployment["parameters"])
    assert parameters == {"settings": SweepSettings(), "remediate": True}
    assert [s["cron"] for s in deployment["schedules"]] == ["0 2 * * *"]
    assert deployment["concurrency_limit"] == 1


def test_medic_sweep_plan_shows_what_runs_next_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from medic.apps.cli.app import app

    monkeypatch.setenv("MEDIC_HOME", str(tmp_path))
    monkeypatch.setenv("MEDIC_DATABASE_URL", f"sqlite:///{tmp_path / 'medic.db'}")
    monkeypatch.setenv("MEDIC_BACKENDS", "sim")
    monkeypatch.setenv("COLUMNS", "400")
    policy = tmp_path / "sweep.yaml"
    policy.write_text(POLICY)
    shown = CliRunner().invoke(app, ["sweep", "plan", "--max-nodes", "4", "--json", "--policy", str(policy)])
    assert shown.exit_code == 0, shown.output
    planned = json.loads(shown.output)
    assert [p["node"] for p in planned["picks"]] == ["gpu-node-1", "gpu-node-2", "gpu-node-3"]  # limit 3
    assert planned["picks"][0]["reasons"] == ["never deep-checked"]
    table = CliRunner().invoke(app, ["sweep", "plan", "--policy", str(policy)])
    assert table.exit_code == 0, table.output
    assert "never deep-checked" in table.output
    assert "gpu-node-3 │ due, but this sweep checks 2 at most" in table.output
