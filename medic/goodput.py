"""Goodput: what each incident cost a training job, minute by minute.

    downtime = checkpoint overhead + Σ over failures (detection + recovery)

Per incident: detection is fault → event received; diagnosis and action are the time spent in
those stages; recovery is fault → the job training past its checkpoint again; lost work is the
training since that checkpoint, redone after the restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from medic.statuses import StepStatus
from medic.store import IncidentDetail
from medic.store.tables import GoodputRecord


@dataclass(frozen=True, slots=True)
class IncidentCost:
    incident: str
    job: str
    fault_at: datetime
    detection_s: float
    diagnosis_s: float
    action_s: float
    recovery_s: float | None  # None: the job was not restarted by this incident
    lost_work_s: float | None

    @classmethod
    def of(cls, row: GoodputRecord) -> IncidentCost:
        """As recorded when the incident closed."""
        return cls(
            row.incident_id,
            row.job,
            row.fault_at,
            row.detection_s,
            row.diagnosis_s,
            row.action_s,
            row.recovery_s,
            row.lost_work_s,
        )

    @property
    def downtime_s(self) -> float:
        return self.detection_s + (self.recovery_s or 0.0)


def _seconds(detail: IncidentDetail, prefix: str) -> float:
    return sum(
        (s.finished_at - s.started_at).total_seconds() for s in detail.steps if s.stage.startswith(prefix)
    )


def incident_costs(detail: IncidentDetail) -> list[IncidentCost]:
    if not detail.events:
        return []
    first = min(detail.events, key=lambda e: e.time)
    detection = max(0.0, (first.received_at - first.time).total_seconds())
    resumed = {
        (s.detail or {}).get("job"): s
        for s in detail.steps
        if s.stage == "resume job" and s.status == StepStatus.OK
    }
    costs = []
    for job in detail.incident.jobs or []:
        step = resumed.get(job)
        costs.append(
            IncidentCost(
                incident=detail.incident.id,
                job=job,
                fault_at=first.time,
                detection_s=detection,
                diagnosis_s=_seconds(detail, "diagnose"),
                action_s=_seconds(detail, "act") + _seconds(detail, "approval"),
                recovery_s=(step.finished_at - first.time).total_seconds() if step else None,
                lost_work_s=(step.detail or {}).get("lost_seconds") if step else None,
            )
        )
    return costs


@dataclass(frozen=True, slots=True)
class JobGoodput:
    job: str
    failures: int
    detection_s: float
    recovery_s: float
    lost_work_s: float
    checkpoint_overhead_s: float | None

    @property
    def downtime_s(self) -> float:
        return (self.checkpoint_overhead_s or 0.0) + self.detection_s + self.recovery_s


def job_goodput(costs: list[IncidentCost], checkpoint_overhead_s: float | None = None) -> JobGoodput:
    return JobGoodput(
        job=costs[0].job if costs else "",
        failures=len(costs),
        detection_s=sum(c.detection_s for c in costs),
        recovery_s=sum(c.recovery_s or 0.0 for c in costs),
        lost_work_s=sum(c.lost_work_s or 0.0 for c in costs),
        checkpoint_overhead_s=checkpoint_overhead_s,
    )
