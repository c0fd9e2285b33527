"""Close: the incident's outcome, as it goes into the store."""

from __future__ import annotations

from dataclasses import asdict

from prefect import task

from medic.goodput import incident_costs
from medic.statuses import IncidentStatus
from medic.store import utcnow
from medic.store.tables import GoodputRecord
from medic.tasks.runtime import prefect_events
from medic.tasks.runtime.process import current
from medic.tasks.runtime.retry import transient_only
from medic.tasks.runtime.stage import stage


@task(
    name="close",
    task_run_name="close {incident_id}: {status}",
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient_only,
    timeout_seconds=30,
)
def close(incident_id: str, outcome: str, status: str = IncidentStatus.CLOSED) -> None:
    rt = current()
    with stage(rt.store, incident_id, "close") as log:
        record = rt.store.update_incident(incident_id, status=status, closed_at=utcnow(), outcome=outcome)
        prefect_events.incident_closed(incident_id, record.node, record.jobs or [], status, outcome)
        detail = rt.store.incident_detail(incident_id)
        costs = incident_costs(detail) if detail else []
        rt.store.record_goodput(
            GoodputRecord(incident_id=c.incident, **{k: v for k, v in asdict(c).items() if k != "incident"})
            for c in costs
        )
        log.done(outcome, goodput=[asdict(c) | {"fault_at": c.fault_at.isoformat()} for c in costs])
