"""From accepted input to flow runs: store first, correlate, then one flow run per incident."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from flows.remediate import Outcome, remediate
from medic.incidents import Incident, correlate
from medic.intake import Intake
from medic.statuses import TERMINAL_INCIDENT_STATUSES, IncidentStatus
from tasks import prefect_events
from tasks.evidence import storms
from tasks.reconcile import reconcile_intents
from tasks.runtime import Runtime


@dataclass(slots=True)
class Dispatch:
    incidents: list[Incident] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    stored_events: int = 0
    rejected: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (incident, why)


def record(rt: Runtime, intake: Intake) -> Dispatch:
    """Store every accepted event and every rejection before anything acts on them."""
    known = rt.store.known_event_ids(e.id for e in intake.events)
    if known:  # a repeated id is ignored, also across runs
        intake.duplicates.extend(e.id for e in intake.events if e.id in known)
        intake.events = [e for e in intake.events if e.id not in known]
    window = timedelta(minutes=rt.policy().policy.defaults.incident_window_minutes)
    incidents = correlate(intake.events, window, storms(rt))
    dispatch = Dispatch(incidents=incidents)
    dispatch.rejected = rt.store.record_rejections(intake.rejected)
    grouped = {e.id for i in incidents for e in i.events}
    rt.store.record_history(e for e in intake.events if e.id not in grouped)
    dispatch.stored_events = rt.store.record_events(incidents)
    for incident in incidents:
        rt.store.open_incident(incident)
        prefect_events.incident_opened(incident)
    return dispatch


async def remediate_all(rt: Runtime, intake: Intake) -> Dispatch:
    reconcile_intents(rt)
    dispatch = record(rt, intake)
    for incident in dispatch.incidents:
        try:
            outcome = await remediate_one(rt, incident)
        except Exception as error:
            dispatch.failed.append((incident.id, f"{type(error).__name__}: {error}"))
            continue
        if outcome is not None:
            dispatch.outcomes.append(outcome)
    return dispatch


async def remediate_one(rt: Runtime, incident: Incident) -> Outcome | None:
    """One flow run for a stored incident; None when it was already handled (replayed input)."""
    existing = rt.store.get_incident(incident.id)
    if existing is not None and existing.status in TERMINAL_INCIDENT_STATUSES:
        return None
    try:
        return await remediate(incident_id=incident.id, node=incident.node)
    except Exception as error:  # recorded on the incident; the caller decides whether to go on
        rt.store.update_incident(
            incident.id, status=IncidentStatus.FAILED, outcome=f"{type(error).__name__}: {error}"
        )
        raise
