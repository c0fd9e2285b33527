"""What the audit chain's tests share: an incident worked through the store's real write paths, and
SQL run behind the store's back (what someone with the database's password could do)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from factories import fault_event, incident
from sqlalchemy import text

from medic.policy.model import Action, Classification, Decision
from medic.store import Store
from medic.store.tables import DiagnosticRecord


def work_incident(store: Store, incident_id: str, node: str, at: datetime, *, close: bool) -> None:
    """Events, the incident, a step, a diagnostic, a decision, an action's intent and outcome and an
    approval, as a flow run writes them; closed at `at` + 10 minutes when `close`."""
    first = fault_event(id=f"{incident_id}-e1", node=node, at=at)
    second = fault_event(id=f"{incident_id}-e2", node=node, at=at, minutes=1)
    store.record_accepted([first, second])
    store.open_or_join(incident(first, second, id=incident_id), runner="test:r:1", lease_s=30)
    store.add_step(incident_id, "triage", at, "ok", f"2 events on {node}")
    store.add_diagnostic(
        DiagnosticRecord(
            incident_id=incident_id, node=node, level=1, result="pass", started_at=at, finished_at=at
        )
    )
    store.add_decision(
        Decision(
            incident=incident_id,
            classification=Classification.HARDWARE,
            action=Action.REBOOT,
            rule="xid-fallen-off-bus",
            reason="XID 79",
            matched=["xid-fallen-off-bus"],
            policy_sha256="ab" * 32,
        ),
        "policies/default.yaml",
    )
    request = store.request_approval(incident_id, "reboot")
    store.answer_approval(request.id or 0, approved=True, by="alice", via="slack")
    key = f"{incident_id}:{node}:reboot"
    store.claim_action(key, incident_id, node, "reboot")
    store.finish_action(key, "succeeded", "back after 41 s")
    if close:
        store.update_incident(incident_id, status="closed", closed_at=at + timedelta(minutes=10))


def sql(store: Store, statement: str, **params: Any) -> Any:
    """Run SQL on the store's database directly, committed: nothing of the store's code runs."""
    with store.engine.begin() as connection:
        result = connection.execute(text(statement), params)
        return result.scalar() if result.returns_rows else result.rowcount
