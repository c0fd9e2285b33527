"""What hardware ageing reads from the store: past incidents with their GPUs, and counter readings.

Read-only, and few queries: `past_incidents` is two (the incidents, then the GPUs their events
named), `counter_readings` one. `medic fleet health` reads both over its window; the flows read
one node's incidents for the policy's `gpu_incidents` condition.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from sqlmodel import col, select

from medic.ageing import PastIncident, Reading
from medic.store.engine import StoreBase
from medic.store.tables import EventRecord, IncidentRecord

# What ageing needs of an incident, not its outcome text or lease.
_INCIDENT_COLUMNS = [
    col(c)
    for c in (
        IncidentRecord.id,
        IncidentRecord.node,
        IncidentRecord.opened_at,
        IncidentRecord.jobs,
        IncidentRecord.owner,
        IncidentRecord.classification,
    )
]


class AgeingMixin(StoreBase):
    def past_incidents(
        self, since: datetime, until: datetime | None = None, node: str | None = None
    ) -> list[PastIncident]:
        """Incidents about a node (not a switch) opened in [since, until], of one node or all, oldest
        first, each with the GPUs its events named, its jobs, owner and classification."""
        incidents = (
            select(*_INCIDENT_COLUMNS)
            .where(IncidentRecord.scope == "node")
            .where(col(IncidentRecord.opened_at) >= since)
        )
        gpus = (
            select(EventRecord.incident_id, EventRecord.gpu)
            .join(IncidentRecord, col(IncidentRecord.id) == col(EventRecord.incident_id))
            .where(IncidentRecord.scope == "node")
            .where(col(IncidentRecord.opened_at) >= since)
            .where(col(EventRecord.gpu).is_not(None))
            .distinct()
        )
        if until is not None:
            incidents = incidents.where(col(IncidentRecord.opened_at) <= until)
            gpus = gpus.where(col(IncidentRecord.opened_at) <= until)
        if node is not None:
            incidents = incidents.where(IncidentRecord.node == node)
            gpus = gpus.where(IncidentRecord.node == node)
        named: dict[str, set[int]] = defaultdict(set)
        with self.session() as s:
            for incident_id, gpu in s.exec(gpus):
                if incident_id is not None and gpu is not None:
                    named[incident_id].add(gpu)
            rows: list[Any] = list(
                s.exec(incidents.order_by(col(IncidentRecord.opened_at), col(IncidentRecord.id)))
            )
        return [
            PastIncident(
                id=row.id,
                node=row.node,
                opened_at=row.opened_at,
                gpus=tuple(sorted(named.get(row.id, ()))),
                jobs=tuple(row.jobs or ()),
                owner=row.owner,
                classification=row.classification,
            )
            for row in rows
        ]

    def counter_readings(self, since: datetime, until: datetime | None = None) -> list[Reading]:
        """The GPU counters events in [since, until] carried (docs/events.md: `counters`)."""
        query = (
            select(EventRecord.node, EventRecord.gpu, EventRecord.time, EventRecord.attributes)
            .where(col(EventRecord.time) >= since)
            .where(col(EventRecord.gpu).is_not(None))
        )
        if until is not None:
            query = query.where(col(EventRecord.time) <= until)
        with self.session() as s:
            rows = list(s.exec(query))
        return [r for row in rows if (r := Reading.of(*row)) is not None]
