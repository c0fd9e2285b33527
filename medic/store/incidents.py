"""Incidents in the store: opened from correlated events, then updated by their flow run.

The statuses an incident goes through are `medic.statuses.IncidentStatus`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlmodel import col, select

from medic.incidents import Incident
from medic.store.engine import StoreBase
from medic.store.tables import (
    ActionRecord,
    DecisionRecord,
    DiagnosticRecord,
    EventRecord,
    IncidentRecord,
    StepRecord,
)


@dataclass(frozen=True, slots=True)
class IncidentDetail:
    incident: IncidentRecord
    events: list[EventRecord]
    steps: list[StepRecord]
    diagnostics: list[DiagnosticRecord]
    decisions: list[DecisionRecord]
    actions: list[ActionRecord]


class IncidentsMixin(StoreBase):
    def open_incident(self, incident: Incident, owner: str | None = None) -> IncidentRecord:
        """Create the incident row, or refresh an existing one with its newest events."""
        with self.session() as s:
            row = s.get(IncidentRecord, incident.id)
            if row is None:
                row = IncidentRecord(
                    id=incident.id,
                    node=incident.node,
                    scope=incident.scope,
                    switch=incident.switch,
                    opened_at=incident.opened_at,
                    last_event_at=incident.last_at,
                    jobs=incident.jobs,
                    owner=owner,
                )
            else:
                row.last_event_at = max(row.last_event_at, incident.last_at)
                row.jobs = sorted(set(row.jobs or []) | set(incident.jobs))
                row.owner = row.owner or owner
            s.add(row)
            s.commit()
            return row

    def update_incident(self, incident_id: str, **fields: Any) -> IncidentRecord:
        with self.session() as s:
            row = s.get(IncidentRecord, incident_id)
            if row is None:
                raise KeyError(incident_id)
            for name, value in fields.items():
                setattr(row, name, value)
            s.add(row)
            s.commit()
            return row

    def find_active_incident(
        self, node: str, statuses: Iterable[str], scope: str = "node"
    ) -> IncidentRecord | None:
        """The node's (or with scope "switch", the switch's) newest incident still in one of these states."""
        query = (
            select(IncidentRecord)
            .where(IncidentRecord.node == node)
            .where(IncidentRecord.scope == scope)
            .where(col(IncidentRecord.status).in_(list(statuses)))
            .order_by(col(IncidentRecord.opened_at).desc())
        )
        with self.session() as s:
            return s.exec(query).first()

    def get_incident(self, incident_id: str) -> IncidentRecord | None:
        with self.session() as s:
            return s.get(IncidentRecord, incident_id)

    def get_incidents(self, incident_ids: Iterable[str]) -> list[IncidentRecord]:
        """The incidents that exist among `incident_ids`, in that order."""
        return [record for i in incident_ids if (record := self.get_incident(i)) is not None]

    def find_incidents(
        self,
        *,
        node: str | None = None,
        job: str | None = None,
        owner: str | None = None,
        since: datetime | None = None,
        limit: int = 200,
    ) -> list[IncidentRecord]:
        """Newest first. `node` and `job` match any event of the incident, not just its first."""
        query = select(IncidentRecord)
        if node or job:
            matching = select(EventRecord.incident_id).where(col(EventRecord.incident_id).is_not(None))
            if node:
                matching = matching.where(EventRecord.node == node)
            if job:
                matching = matching.where(EventRecord.job == job)
            query = query.where(col(IncidentRecord.id).in_(matching))
        if owner:
            query = query.where(IncidentRecord.owner == owner)
        if since:
            query = query.where(col(IncidentRecord.opened_at) >= since)
        query = query.order_by(col(IncidentRecord.opened_at).desc()).limit(limit)
        with self.session() as s:
            return list(s.exec(query))

    def incident_detail(self, incident_id: str) -> IncidentDetail | None:
        with self.session() as s:
            row = s.get(IncidentRecord, incident_id)
            if row is None:
                return None

            def rows(table: Any, order: Any) -> list[Any]:
                return list(s.exec(select(table).where(table.incident_id == incident_id).order_by(order)))

            return IncidentDetail(
                incident=row,
                events=rows(EventRecord, col(EventRecord.time)),
                steps=rows(StepRecord, col(StepRecord.id)),
                diagnostics=rows(DiagnosticRecord, col(DiagnosticRecord.id)),
                decisions=rows(DecisionRecord, col(DecisionRecord.id)),
                actions=rows(ActionRecord, col(ActionRecord.id)),
            )
