"""`medic fleet health` and what it reads from the store (medic/store/ageing.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from factories import fault_event
from typer.testing import CliRunner

from medic.ageing import PastIncident, Reading
from medic.apps.cli.app import app
from medic.events import FaultEvent
from medic.incidents import Incident, correlate
from medic.store import Store

runner = CliRunner()
NOW = datetime.now(UTC).replace(microsecond=0)


def ago(days: float) -> datetime:
    return NOW - timedelta(days=days)


def one(*events: FaultEvent) -> Incident:
    (incident,) = correlate(events)
    return incident


def worn(day: float, job: str, ecc: int, minutes: float = 0) -> FaultEvent:
    return fault_event(
        node="gpu-7", gpu=3, job=job, at=ago(day), minutes=minutes, counters={"ecc_corrected": ecc}
    )


def seed(store: Store) -> dict[str, Incident]:
    """gpu-7's GPU 3 failing across jobs and owners with its ECC count climbing; gpu-2 failing in one
    job's code; a switch storm and a month-old incident the window leaves out."""
    incidents = {
        "a": one(worn(9, "j1", 100), worn(9, "j1", 101, minutes=1)),
        "b": one(worn(5, "j2", 260)),
        "c": one(worn(1, "j3", 420), fault_event("job_crash", node="gpu-7", job="j3", at=ago(1))),
        "app-1": one(fault_event("nan_loss", node="gpu-2", gpu=0, job="j9", at=ago(6))),
        "app-2": one(fault_event("nan_loss", node="gpu-2", gpu=0, job="j9", at=ago(2))),
        "old": one(fault_event(node="gpu-7", gpu=3, job="j0", at=ago(45))),
        "storm": Incident(
            id="inc-storm",
            node="leaf-1",
            scope="switch",
            events=[fault_event("nccl_timeout", node=f"gpu-{n}", gpu=0, at=ago(3)) for n in (4, 5)],
        ),
    }
    owners = {"a": "alice", "b": "alice", "c": "bob", "app-1": "carol", "app-2": "carol", "old": "alice"}
    classifications = {"app-1": "software", "app-2": "software"}
    for name, incident in incidents.items():
        store.record_events([incident])
        store.open_incident(incident, owner=owners.get(name))
        store.update_incident(
            incident.id, status="closed", classification=classifications.get(name, "hardware")
        )
    return incidents


def test_past_incidents_name_their_gpus_jobs_owner_and_classification(store: Store) -> None:
    made = seed(store)
    found = store.past_incidents(ago(30))
    assert [p.id for p in found] == [
        made[n].id for n in ("a", "app-1", "b", "app-2", "c")
    ]  # no switch, no old
    a = found[0]
    assert a == PastIncident(made["a"].id, "gpu-7", made["a"].opened_at, (3,), ("j1",), "alice", "hardware")
    assert found[-1].gpus == (3,)  # its job crash names no GPU
    assert [p.id for p in store.past_incidents(ago(30), until=ago(3), node="gpu-7")] == [
        made["a"].id,
        made["b"].id,
    ]


def test_counter_readings_are_the_counters_events_carried(store: Store) -> None:
    seed(store)
    readings = sorted(store.counter_readings(ago(30), until=NOW), key=lambda r: r.time)
    assert readings[0] == Reading("gpu-7", 3, ago(9), {"ecc_corrected": 100})
    assert [r.counters["ecc_corrected"] for r in readings] == [100, 101, 260, 420]
    assert {(r.node, r.gpu) for r in readings} == {("gpu-7", 3)}
    assert [r.counters for r in store.counter_readings(ago(4), until=ago(2))] == []


@pytest.fixture
def seeded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Incident]:
    url = f"sqlite:///{tmp_path / 'medic.db'}"
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path))
    monkeypatch.setenv("MEDIC_DATABASE_URL", url)
    monkeypatch.setenv("COLUMNS", "400")
    store = Store(url)
    made = seed(store)
    store.close()
    return made


def health(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["fleet", "health", "--json", *args])
    assert result.exit_code == 0, result.output
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


# The JSON contract (docs/fleet-health.md#json): fields are only ever added.
TOP_KEYS = {"schema_version", "since", "until", "incidents", "nodes_scored", "nodes"}
NODE_KEYS = {"rank", "node", "score", "incidents", "mtbi_hours", "gpus"}
GPU_KEYS = {
    "gpu",
    "score",
    "incidents",
    "jobs",
    "owners",
    "first_at",
    "last_at",
    "mtbi_hours",
    "trends",
    "evidence",
}
TREND_KEYS = {"counter", "per_day", "threshold_per_day", "readings", "first", "last"}
EVIDENCE_KEYS = {"points", "why"}


def test_json_is_pinned(seeded: dict[str, Incident]) -> None:
    report = health()
    assert set(report) == TOP_KEYS and report["schema_version"] == 1
    assert (report["incidents"], report["nodes_scored"]) == (3, 1)  # the application's two do not count
    (node,) = report["nodes"]
    assert set(node) == NODE_KEYS
    assert (node["rank"], node["node"], node["incidents"]) == (1, "gpu-7", 3)
    gpu, whole = node["gpus"]
    assert set(gpu) == set(whole) == GPU_KEYS
    assert (gpu["gpu"], gpu["jobs"], gpu["owners"], whole["gpu"]) == (
        3,
        ["j1", "j2", "j3"],
        ["alice", "bob"],
        None,
    )
    (trend,) = gpu["trends"]
    assert set(trend) == TREND_KEYS
    assert (trend["counter"], trend["first"], trend["last"], trend["readings"]) == (
        "ecc_corrected",
        100,
        420,
        4,
    )
    assert all(set(e) == EVIDENCE_KEYS for e in gpu["evidence"])
    assert node["score"] == gpu["score"] == sum(e["points"] for e in gpu["evidence"])
    assert [e["why"].split(":")[0] for e in gpu["evidence"][1:3]] == ["3 jobs", "2 owners"]


def test_since_and_top(seeded: dict[str, Incident]) -> None:
    assert health("--since", "3d")["incidents"] == 1
    assert health("--since", "60d")["incidents"] == 4  # the month-old one too
    assert len(health("--top", "1")["nodes"]) == 1
    bad = runner.invoke(app, ["fleet", "health", "--since", "last week"])
    assert bad.exit_code == 2 and "30m, 6h, 7d" in bad.output
    assert runner.invoke(app, ["fleet", "health", "--top", "0"]).exit_code == 2


def test_table(seeded: dict[str, Incident]) -> None:
    result = runner.invoke(app, ["fleet", "health"])
    assert result.exit_code == 0, result.output
    assert "1 of 1 nodes with evidence of ageing" in result.output
    assert "gpu-7" in result.output and "3 jobs: j1, j2, j3" in result.output


def test_an_empty_store(tmp_path: Path) -> None:
    result = runner.invoke(app, ["fleet", "health", "--store", f"sqlite:///{tmp_path / 'empty.db'}"])
    assert result.exit_code == 0, result.output
    assert "No node shows evidence of ageing since" in result.output
