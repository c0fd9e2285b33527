"""Close: the incident's outcome, as it goes into the store."""

from __future__ import annotations

from prefect import task

from medic.store import utcnow
from tasks.runtime import current
from tasks.stage import stage


@task(name="close", retries=2, retry_delay_seconds=1, timeout_seconds=30)
def close(incident_id: str, outcome: str, status: str = "closed") -> None:
    rt = current()
    with stage(rt.store, incident_id, "close") as log:
        rt.store.update_incident(incident_id, status=status, closed_at=utcnow(), outcome=outcome)
        log.done(outcome)
