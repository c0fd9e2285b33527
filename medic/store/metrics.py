"""Counts and delays over the whole store, for `medic serve`'s /metrics (medic/apps/server/metrics.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func
from sqlmodel import SQLModel, col, select

from medic.statuses import IncidentStatus, StepStatus
from medic.store.engine import StoreBase
from medic.store.tables import (
    ActionRecord,
    ApprovalRecord,
    DecisionRecord,
    EventRecord,
    IncidentRecord,
    StepRecord,
)

# medic/tasks/nodes/contain.py's stage: the store names it, not imports it (the store sits below the tasks).
CONTAIN_STAGE = "contain"


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
        decided = (
            select(DecisionRecord.incident_id, func.min(DecisionRecord.decided_at).label("at"))
            .group_by(col(DecisionRecord.incident_id))
            .subquery()
        )
        return self._since_arrival(decided)

    def contain_delays(self) -> list[float]:
        """Per contained incident: seconds from its first event's arrival to the end of its containment's
        drain (medic/tasks/nodes/contain.py), the moment the scheduler stopped placing work on the node."""
        contained = (
            select(StepRecord.incident_id, func.min(StepRecord.finished_at).label("at"))
            .where(StepRecord.stage == CONTAIN_STAGE)
            .where(StepRecord.status == StepStatus.OK)
            .group_by(col(StepRecord.incident_id))
            .subquery()
        )
        return self._since_arrival(contained)

    def _since_arrival(self, done: Any) -> list[float]:
        """Per incident in `done` (incident_id, at): seconds from its first event's arrival to `at`."""
        arrived = (
            select(EventRecord.incident_id, func.min(EventRecord.received_at).label("at"))
            .where(col(EventRecord.incident_id).is_not(None))
            .group_by(col(EventRecord.incident_id))
            .subquery()
        )
        query = select(arrived.c.at, done.c.at).join(done, done.c.incident_id == arrived.c.incident_id)
        with self.session() as s:
            return [
                max(0.0, (_utc(finished) - _utc(came)).total_seconds()) for came, finished in s.exec(query)
            ]

    def approval_waits(self) -> list[float]:
        """Per unanswered approval request of an incident still waiting on it: seconds since it was asked.
        A request whose incident moved on (its run was picked up again, or ended) is no longer waited on."""
        query = (
            select(ApprovalRecord.requested_at)
            .join(IncidentRecord, col(IncidentRecord.id) == col(ApprovalRecord.incident_id))
            .where(col(ApprovalRecord.answered_at).is_(None))
            .where(IncidentRecord.status == IncidentStatus.WAITING_FOR_APPROVAL)
        )
        now = datetime.now(UTC)
        with self.session() as s:
            return [max(0.0, (now - _utc(asked)).total_seconds()) for asked in s.exec(query)]

    def guardrail_blocks(self) -> dict[str, int]:
        """How many incidents each guardrail stopped an action of (their decisions name it)."""
        query = (
            select(DecisionRecord.guardrail, func.count(func.distinct(DecisionRecord.incident_id)))
            .where(col(DecisionRecord.guardrail).is_not(None))
            .group_by(col(DecisionRecord.guardrail))
        )
        with self.session() as s:
            return {guardrail: n for guardrail, n in s.exec(query) if guardrail}

    def action_counts(self) -> dict[tuple[str, str], int]:
        """How many node actions per (action, status): intent, succeeded, failed."""
        query = select(ActionRecord.action, ActionRecord.status, func.count()).group_by(
            col(ActionRecord.action), col(ActionRecord.status)
        )
        with self.session() as s:
            return {(action, status): n for action, status, n in s.exec(query)}


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value
