"""`medic goodput`: what incidents cost each job, from the store."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from medic.apps.cli._common import console
from medic.config import load_settings
from medic.goodput import IncidentCost, job_goodput
from medic.store import Store


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def goodput(
    job: Annotated[str | None, typer.Option(help="Only this job.")] = None,
    save_seconds: Annotated[
        float | None, typer.Option(help="Checkpoint save time, to add checkpoint overhead to downtime.")
    ] = None,
    interval_seconds: Annotated[float | None, typer.Option(help="Seconds between checkpoints.")] = None,
) -> None:
    """What incidents cost each job: detection, diagnosis, action, recovery, lost work, downtime."""
    rows = Store(load_settings().database_url).goodput(job)
    costs = [IncidentCost.of(r) for r in rows]
    per_incident = Table(title="Per incident (seconds)", title_justify="left")
    for column in (
        "incident",
        "job",
        "fault at",
        "detection",
        "diagnosis",
        "action",
        "recovery",
        "lost work",
    ):
        per_incident.add_column(column, justify="right" if column not in ("incident", "job") else "left")
    for c in costs:
        per_incident.add_row(
            c.incident,
            c.job,
            f"{c.fault_at:%Y-%m-%d %H:%M:%S}",
            _seconds(c.detection_s),
            _seconds(c.diagnosis_s),
            _seconds(c.action_s),
            _seconds(c.recovery_s),
            _seconds(c.lost_work_s),
        )
    console.print(per_incident)
    per_job = Table(
        title="Per job: downtime = checkpoint overhead + Σ (detection + recovery)", title_justify="left"
    )
    for column in (
        "job",
        "failures",
        "detection",
        "recovery",
        "lost work",
        "checkpoint overhead",
        "downtime",
    ):
        per_job.add_column(column, justify="left" if column == "job" else "right")
    for name in sorted({c.job for c in costs}):
        mine = [c for c in costs if c.job == name]
        overhead = None
        if save_seconds and interval_seconds and mine:
            span = (max(c.fault_at for c in mine) - min(c.fault_at for c in mine)).total_seconds()
            overhead = save_seconds / interval_seconds * span
        total = job_goodput(mine, overhead)
        per_job.add_row(
            name,
            str(total.failures),
            _seconds(total.detection_s),
            _seconds(total.recovery_s),
            _seconds(total.lost_work_s),
            _seconds(total.checkpoint_overhead_s),
            _seconds(total.downtime_s),
        )
    console.print(per_job)
