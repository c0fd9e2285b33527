"""Rebuilding an incident from the store and deciding on it: shared by triage, the ladder and decide."""

from __future__ import annotations

from datetime import timedelta

from integrations.protocols import DiagnosticResult
from medic.facts import HISTORY_WINDOW, facts_of
from medic.incidents import Incident
from medic.policy import Decision, decide
from medic.store import utcnow
from medic.store.tables import DiagnosticRecord
from tasks.runtime import Runtime


def load_incident(rt: Runtime, incident_id: str) -> Incident:
    record = rt.store.get_incident(incident_id)
    if record is None:
        raise LookupError(f"incident {incident_id} is not in the store")
    incident = Incident(id=incident_id, node=record.node, events=rt.store.incident_events(incident_id))
    # History before this incident only: our own actions for it are not "repeat" evidence.
    since = utcnow() - HISTORY_WINDOW - timedelta(hours=1)
    incident.history = [
        h for h in rt.store.node_history(record.node, since) if h.attributes.get("incident") != incident_id
    ]
    return incident


def record_diagnostic(rt: Runtime, incident_id: str, result: DiagnosticResult, note: str = "") -> None:
    rt.store.add_diagnostic(
        DiagnosticRecord(
            incident_id=incident_id,
            node=result.node,
            level=result.level,
            result=result.result,
            error_ids=list(result.error_ids),
            started_at=result.started_at or utcnow(),
            finished_at=result.finished_at or utcnow(),
            detail=f"{note}{result.detail}",
        )
    )


def evaluate(rt: Runtime, incident_id: str) -> Decision:
    """Decide on the incident as the store knows it now, with the policy file as it is now."""
    incident = load_incident(rt, incident_id)
    out_of_service = rt.backends.scheduler.node(incident.node).drained_by_medic
    loaded = rt.policy()
    facts = facts_of(incident, out_of_service=out_of_service, now=utcnow())
    decision = decide(loaded.policy, facts, loaded.sha256)
    rt.store.add_decision(decision, loaded.path)
    return decision
