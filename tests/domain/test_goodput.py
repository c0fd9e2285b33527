"""Goodput arithmetic: downtime = checkpoint overhead + Σ (detection + recovery)."""

from __future__ import annotations

from datetime import UTC, datetime

from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.goodput import IncidentCost, job_goodput
from medic.store import Store
from medic.store.tables import GoodputRecord

T = datetime(2026, 11, 1, tzinfo=UTC)


def test_job_downtime_adds_detection_recovery_and_checkpoint_overhead() -> None:
    costs = [
        IncidentCost(
            "a", "llm", T, detection_s=10, diagnosis_s=5, action_s=2, recovery_s=100, lost_work_s=300
        ),
        IncidentCost(
            "b", "llm", T, detection_s=20, diagnosis_s=0, action_s=0, recovery_s=None, lost_work_s=None
        ),
    ]
    total = job_goodput(costs, checkpoint_overhead_s=50)
    assert (total.failures, total.detection_s, total.recovery_s, total.lost_work_s) == (2, 30, 100, 300)
    assert total.downtime_s == 50 + 30 + 100
    assert costs[0].downtime_s == 110 and costs[1].downtime_s == 20


def test_medic_goodput_prints_per_incident_and_per_job(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'm.db'}"
    Store(url).record_goodput(
        [
            GoodputRecord(
                incident_id="inc-1",
                job="llm",
                fault_at=T,
                detection_s=12.5,
                diagnosis_s=3,
                action_s=1,
                recovery_s=240,
                lost_work_s=600,
            )
        ]
    )
    monkeypatch.setenv("MEDIC_DATABASE_URL", url)
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(app, ["goodput", "--job", "llm"])
    assert result.exit_code == 0, result.output
    assert "inc-1" in result.output and "240.0" in result.output and "600.0" in result.output
    assert "252.5" in result.output  # downtime: 12.5 + 240
