"""From accepted input to flow runs: store first, correlate, then one flow run per incident."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from medic.flows.leases import Leases, lease_seconds, runner_name
from medic.flows.remediate import Outcome, remediate
from medic.incidents import Incident, correlate
from medic.intake import Intake
from medic.statuses import TERMINAL_INCIDENT_STATUSES, IncidentStatus
from medic.store.tables import IncidentRecord
from medic.tasks.nodes.evidence import storms
from medic.tasks.nodes.reconcile import reconcile_intents
from medic.tasks.runtime import prefect_events
from medic.tasks.runtime.process import Runtime


@dataclass(slots=True)
class Dispatch:
    incidents: list[Incident] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    stored_events: int = 0
    rejected: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (incident, why)


def record(rt: Runtime, intake: Intake, leases: Leases | None = None) -> Dispatch:
    """Store every accepted event and every rejection before anything acts on them, then open
    the incidents. An incident for a node (switch) already being handled, by this process or any
    other, is not opened twice: the new events join it, and `incidents` lists only those this
    process runs (holding their leases when `leases` is given)."""
    known = rt.store.known_event_ids(e.id for e in intake.events)
    if known:  # a repeated id is ignored, also across runs
        intake.duplicates.extend(e.id for e in intake.events if e.id in known)
        intake.events = [e for e in intake.events if e.id not in known]
    window = timedelta(minutes=rt.policy().policy.defaults.incident_window_minutes)
    incidents = correlate(intake.events, window, storms(rt))
    dispatch = Dispatch()
    dispatch.rejected = rt.store.record_rejections(intake.rejected)
    dispatch.stored_events = len(rt.store.record_accepted(intake.events))
    runner = leases.runner if leases else runner_name("record")
    lease_s = leases.lease_s if leases else lease_seconds()
    for incident in incidents:
        row, opened = rt.store.open_or_join(incident, runner=runner, lease_s=lease_s, window=window)
        if opened:
            prefect_events.incident_opened(incident)
            if leases is not None:
                leases.hold(row.id)
        elif leases is None or not leases.claim(row.id):
            continue  # its run is someone else's, or it was handled before
        dispatch.incidents.append(incident if opened else stored(row))
    return dispatch


async def remediate_all(rt: Runtime, intake: Intake) -> Dispatch:
    leases = Leases(rt.store, runner_name("ingest"))
    try:
        dispatch = record(rt, intake, leases)
        reconcile_intents(rt, {incident.id for incident in dispatch.incidents})
        for incident in dispatch.incidents:
            try:
                outcome = await remediate_one(rt, incident)
            except Exception as error:
                dispatch.failed.append((incident.id, f"{type(error).__name__}: {error}"))
                continue
            finally:
                leases.release(incident.id)
            if outcome is not None:
                dispatch.outcomes.append(outcome)
    finally:
        leases.close()
    return dispatch


def stored(row: IncidentRecord) -> Incident:
    """A stored incident as the flow's input (its events are read from the store)."""
    return Incident(id=row.id, node=row.node, scope=row.scope)  # type: ignore[arg-type]


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
