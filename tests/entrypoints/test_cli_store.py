"""`medic incidents` and `medic incident` against a store seeded in tmp_path (SQLite)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from factories import fault_event
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.incidents import Incident, correlate
from medic.policy.model import Action, Classification, Decision
from medic.store import Store

runner = CliRunner()
POLICY_SHA = "0123456789abcdef" * 4
INCIDENT_KEYS = {
    "id",
    "node",
    "scope",
    "switch",
    "opened_at",
    "last_event_at",
    "closed_at",
    "status",
    "jobs",
    "owner",
    "classification",
    "action",
    "rule",
    "outcome",
    "flow_run_id",
    "flow_run_name",
}


@dataclass(frozen=True)
class Seeded:
    bus: Incident  # gpu-001, job j-1, owner alice, 10 minutes ago: fully worked
    mixed: Incident  # gpu-002, jobs j-1 then j-2, owner bob, 20 minutes ago
    old: Incident  # gpu-003, job j-3, owner alice, 3 days ago


@pytest.fixture
def seeded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Seeded:
    url = f"sqlite:///{tmp_path / 'medic.db'}"
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path))
    monkeypatch.setenv("MEDIC_DATABASE_URL", url)
    monkeypatch.setenv("COLUMNS", "400")  # rich must not fold ids across lines
    now = datetime.now(UTC).replace(microsecond=0)
    events = [
        fault_event(id="bus-1", node="gpu-001", at=now, minutes=-10, gpu=3, job="j-1"),
        fault_event(id="bus-2", node="gpu-001", at=now, minutes=-9, gpu=3, job="j-1"),
        fault_event("nan_loss", id="mix-1", node="gpu-002", at=now, minutes=-20, job="j-1", rank=0),
        fault_event("nccl_timeout", id="mix-2", node="gpu-002", at=now, minutes=-19, job="j-2", rank=8),
        fault_event("node_unreachable", id="old-1", node="gpu-003", at=now - timedelta(days=3), job="j-3"),
    ]
    incidents = {i.node: i for i in correlate(events)}
    bus, mixed, old = incidents["gpu-001"], incidents["gpu-002"], incidents["gpu-003"]

    store = Store(url)
    store.record_events([bus, mixed, old])
    store.open_incident(bus, owner="alice")
    store.open_incident(mixed, owner="bob")
    store.open_incident(old, owner="alice")

    started = now - timedelta(minutes=8)
    store.add_step(bus.id, "triage", started, "ok", "2 events on gpu-001, XID 79")
    store.add_decision(
        Decision(
            incident=bus.id,
            classification=Classification.HARDWARE,
            action=Action.REBOOT,
            rule="xid-fallen-off-bus",
            reason="XID 79, the GPU has fallen off the bus: XID 79",
            matched=["xid-fallen-off-bus"],
            policy_sha256=POLICY_SHA,
        ),
        "policies/default.yaml",
    )
    key = f"{bus.id}:reboot:gpu-001"
    _, claimed = store.claim_action(key, bus.id, "gpu-001", "reboot")
    assert claimed
    store.finish_action(key, "succeeded", "node back after 41 s")
    store.add_step(bus.id, "remediate", started, "ok", "rebooted gpu-001")
    store.add_step(bus.id, "verify", started, "skipped", "verification not configured")
    store.update_incident(
        bus.id,
        status="closed",
        classification="hardware",
        action="reboot",
        rule="xid-fallen-off-bus",
        outcome="rebooted; back in service",
        closed_at=now,
    )
    store.close()
    return Seeded(bus, mixed, old)


def listed(*args: str) -> list[dict[str, Any]]:
    result = runner.invoke(app, ["incidents", *args, "--json"])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def ids(*args: str) -> list[str]:
    return [row["id"] for row in listed(*args)]


def test_all_incidents_newest_first(seeded: Seeded) -> None:
    assert ids() == [seeded.bus.id, seeded.mixed.id, seeded.old.id]


def test_json_rows(seeded: Seeded) -> None:
    rows = {row["id"]: row for row in listed()}
    assert all(set(row) == INCIDENT_KEYS for row in rows.values())  # as listed in docs/cli.md
    bus = rows[seeded.bus.id]
    assert (bus["node"], bus["scope"]) == ("gpu-001", "node")
    assert bus["status"] == "closed"
    assert (bus["classification"], bus["action"], bus["rule"]) == ("hardware", "reboot", "xid-fallen-off-bus")
    assert bus["jobs"] == ["j-1"] and bus["owner"] == "alice"
    assert datetime.fromisoformat(bus["opened_at"]) == seeded.bus.opened_at
    assert rows[seeded.mixed.id]["jobs"] == ["j-1", "j-2"]
    assert rows[seeded.mixed.id]["status"] == "open"


def test_filter_by_node(seeded: Seeded) -> None:
    assert ids("--node", "gpu-001") == [seeded.bus.id]
    assert ids("--node", "gpu-404") == []


def test_filter_by_job_matches_any_event(seeded: Seeded) -> None:
    assert ids("--job", "j-2") == [seeded.mixed.id]  # not the incident's first event's job
    assert ids("--job", "j-1") == [seeded.bus.id, seeded.mixed.id]


def test_filter_by_owner(seeded: Seeded) -> None:
    assert ids("--owner", "alice") == [seeded.bus.id, seeded.old.id]
    assert ids("--owner", "alice", "--node", "gpu-003") == [seeded.old.id]


@pytest.mark.parametrize(
    ("since", "expected"),
    [("1h", ["bus", "mixed"]), ("15m", ["bus"]), ("7d", ["bus", "mixed", "old"]), ("90m", ["bus", "mixed"])],
)
def test_filter_by_span(seeded: Seeded, since: str, expected: list[str]) -> None:
    assert ids("--since", since) == [getattr(seeded, name).id for name in expected]


def test_filter_by_rfc3339_time(seeded: Seeded) -> None:
    cut = seeded.mixed.opened_at - timedelta(seconds=1)
    assert ids("--since", cut.isoformat()) == [seeded.bus.id, seeded.mixed.id]
    naive_utc = cut.replace(tzinfo=None).isoformat()  # no offset: read as UTC
    assert ids("--since", naive_utc) == [seeded.bus.id, seeded.mixed.id]


@pytest.mark.parametrize("since", ["yesterday", "1w", "h", "-1h", "2025-13-01"])
def test_bad_since_is_a_clear_usage_error(seeded: Seeded, since: str) -> None:
    result = runner.invoke(app, ["incidents", "--since", since])
    assert result.exit_code == 2
    assert "RFC 3339 time or a span like 30m, 6h, 7d" in result.stderr
    assert result.stdout == ""


def test_table(seeded: Seeded) -> None:
    result = runner.invoke(app, ["incidents", "--node", "gpu-002"])
    assert result.exit_code == 0, result.output
    assert "1 incidents" in result.stdout
    assert seeded.mixed.id in result.stdout and "bob" in result.stdout and "j-1, j-2" in result.stdout
    assert seeded.bus.id not in result.stdout


def test_empty_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MEDIC_DATABASE_URL", raising=False)
    result = runner.invoke(app, ["incidents"])
    assert result.exit_code == 0, result.output
    assert "0 incidents" in result.stdout
    assert (tmp_path / "home" / "medic.db").is_file()  # the default URL lives under MEDIC_HOME


def test_incident_shows_evidence_decisions_actions_and_stages(seeded: Seeded) -> None:
    result = runner.invoke(app, ["incident", seeded.bus.id])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"Incident {seeded.bus.id} on gpu-001" in out
    assert "closed" in out and "rebooted; back in service" in out and "j-1 / alice" in out
    # Evidence: both events, with their attributes.
    assert "Evidence" in out
    assert out.count("code=79") == 2
    # Decisions: rule, reason and which policy text made it.
    assert "Decisions" in out
    assert "XID 79, the GPU has fallen off the bus: XID 79" in out
    assert POLICY_SHA[:12] in out
    # Actions: intent then outcome.
    assert "Actions" in out
    assert "succeeded" in out and "node back after 41 s" in out
    # Stages, in order.
    assert f"{seeded.bus.id} on gpu-001: stages" in out
    stages = [out.index(summary) for summary in ("2 events on gpu-001", "rebooted gpu-001", "not configured")]
    assert stages == sorted(stages)
    assert "skipped" in out


def test_incident_without_work_yet(seeded: Seeded) -> None:
    result = runner.invoke(app, ["incident", seeded.mixed.id])
    assert result.exit_code == 0, result.output
    assert "nan_loss" in result.stdout and "nccl_timeout" in result.stdout
    assert "open" in result.stdout


def test_unknown_incident_exits_1(seeded: Seeded) -> None:
    result = runner.invoke(app, ["incident", "inc-0000000000"])
    assert result.exit_code == 1
    assert "no incident inc-0000000000" in result.stderr
    assert result.stdout == ""
