"""Counts and delays over the whole store, for `medic serve`'s /metrics (apps/server/metrics.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import func
from sqlmodel import SQLModel, col, select

from medic.store.engine import StoreBase
from medic.store.tables import ActionRecord, DecisionRecord, EventRecord, IncidentRecord


class MetricsMixin(StoreBase):
    def count(self, table: type[SQLModel]) -> int:
        with self.session() as s:
            return s.exec(select(func.count()).select_from(table)).one()

    def open_incident_count(self) -> int:
        query = (
            select(func.count()).select_from(IncidentRecord).where(col(IncidentRecord.closed_at).is_(None))
        )
        with self.session() as s:
            return s.exec(query).one()

    def decision_delays(self) -> list[float]:
        """Per decided incident: seconds from its first event's arrival to its first decision."""
        arrived = (
            select(EventRecord.incident_id, func.min(EventRecord.received_at).label("at"))
            .where(col(EventRecord.incident_id).is_not(None))
            .group_by(col(EventRecord.incident_id))
            .subquery()
        )
        decided = (
            select(DecisionRecord.incident_id, func.min(DecisionRecord.decided_at).label("at"))
            .group_by(col(DecisionRecord.incident_id))
            .subquery()
        )
        query = select(arrived.c.at, decided.c.at).join(
            decided, decided.c.incident_id == arrived.c.incident_id
        )
        with self.session() as s:
            return [max(0.0, (_utc(done) - _utc(came)).total_seconds()) for came, done in s.exec(query)]

    def action_counts(self) -> dict[tuple[str, str], int]:
        """How many node actions per (action, status): intent, succeeded, failed."""
        query = select(ActionRecord.action, ActionRecord.status, func.count()).group_by(
            col(ActionRecord.action), col(ActionRecord.status)
        )
        with self.session() as s:
            return {(action, status): n for action, status, n in s.exec(query)}


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value
