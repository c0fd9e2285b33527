"""Fault events in the store: accepted, tied to incidents, and a node's remediation history.

An event id is stored once: every writer skips the ids already there, and the HTTP ingest,
which races other writers, looks again when a concurrent one stored an id first.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, or_, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import col, select

from medic.context import Around
from medic.culprit import LIVE_REPORTS
from medic.events import EventKind, FaultEvent
from medic.incidents import Incident
from medic.store.actions import succeeded_actions
from medic.store.engine import StoreBase, utcnow
from medic.store.ledger import audited
from medic.store.tables import EventRecord

# Actions that count as a remediation in a node's history (drains and resumes do not).
NODE_REMEDIATIONS = frozenset({"reset_gpu", "reboot", "replace"})
# Kinds stored as evidence that no incident ever holds: a node's remediation history, and what people
# (or the scheduler) did to a node (docs/decisions/0019). Never handed on, never waited for.
NO_INCIDENT_KINDS = ("remediation", "node_state")


class EventsMixin(StoreBase):
    def known_event_ids(self, ids: Iterable[str]) -> set[str]:
        wanted = list(ids)
        found: set[str] = set()
        with self.session() as s:
            for start in range(0, len(wanted), 500):
                chunk = wanted[start : start + 500]
                found.update(s.exec(select(EventRecord.id).where(col(EventRecord.id).in_(chunk))))
        return found

    def record_events(self, incidents: Iterable[Incident], received_at: datetime | None = None) -> int:
        """Store each incident's events (one transaction); ids already stored are skipped."""
        received_at = received_at or utcnow()
        pairs = [(e, i.id) for i in incidents for e in i.events]
        known = self.known_event_ids(e.id for e, _ in pairs)
        rows = [_event_row(e, inc, received_at) for e, inc in pairs if e.id not in known]
        with self.session() as s:
            s.add_all(rows)
            s.commit()
        return len(rows)

    def add_event(self, event: FaultEvent, incident_id: str | None) -> bool:
        """Store one event (e.g. a diagnostic result we produced); False if its id was known."""
        with self.session() as s:
            if s.get(EventRecord, event.id) is not None:
                return False
            s.add(_event_row(event, incident_id, utcnow()))
            s.commit()
            return True

    def record_history(self, events: Iterable[FaultEvent]) -> None:
        """Store events that belong to no incident (a node's remediation history)."""
        events = list(events)
        known = self.known_event_ids(e.id for e in events)
        with self.session() as s:
            s.add_all(_event_row(e, None, utcnow()) for e in events if e.id not in known)
            s.commit()

    def record_accepted(self, events: Iterable[FaultEvent]) -> list[FaultEvent]:
        """Store events not yet tied to an incident (one transaction); returns the ones that were new.

        Used where an event must be durable before anyone correlates it (the HTTP ingest).
        A concurrent writer may store one of the same ids first: then look again and skip it.
        """
        unique: dict[str, FaultEvent] = {}
        for event in events:
            unique.setdefault(event.id, event)
        received_at = utcnow()
        while True:
            known = self.known_event_ids(unique)
            fresh = [e for e in unique.values() if e.id not in known]
            if not fresh:
                return fresh
            with self.session() as s:
                # A bulk INSERT, not ORM objects: building those costs 10x the write itself.
                try:
                    audited(s, insert(EventRecord), [_event_values(e, None, received_at) for e in fresh])
                    s.commit()
                except IntegrityError:
                    s.rollback()
                    continue
            return fresh

    def attach_events(self, incidents: Iterable[Incident]) -> int:
        """Tie stored events that have no incident yet to their incident; returns the rows changed."""
        changed = 0
        with self.session() as s:
            for incident in incidents:
                ids = [e.id for e in incident.events]
                query = (
                    update(EventRecord)
                    .where(col(EventRecord.id).in_(ids))
                    .where(col(EventRecord.incident_id).is_(None))
                    .values(incident_id=incident.id)
                )
                changed += len(audited(s, query))
            s.commit()
        return changed

    def undispatched_events(self) -> list[FaultEvent]:
        """Accepted events no incident holds yet, oldest first: what a start hands on again. A node's
        remediation history and what people did to it (`node_state`) are no incident's and are left
        out; so are a job's live reports (`LIVE_REPORTS`), which no incident holds either: the
        differential reads them as they come, and the next window's take the place of those a
        restart found; and the events it absorbed as another's evidence (`mark_explained`)."""
        check = func.coalesce(col(EventRecord.attributes)["check"].as_string(), "")
        query = (
            select(EventRecord)
            .where(col(EventRecord.incident_id).is_(None))
            .where(col(EventRecord.explained_by).is_(None))
            .where(col(EventRecord.kind).not_in(NO_INCIDENT_KINDS))
            .where(
                or_(col(EventRecord.kind) != EventKind.HEALTH_CHECK.value, check.not_in(sorted(LIVE_REPORTS)))
            )
            .order_by(col(EventRecord.time), col(EventRecord.id))
        )
        with self.session() as s:
            return [_event_of(r) for r in s.exec(query)]

    def mark_explained(self, pairs: Iterable[tuple[str, str]]) -> int:
        """Mark events absorbed as another's evidence, each (its id, the id of the event that
        explains it), where no incident holds them and nothing explained them before; returns the rows
        changed. Handed on again after a restart, a victim's crash would find nothing to explain it
        (that fault is in its incident by then) and open an incident on a healthy node."""
        pairs = list(pairs)
        if not pairs:  # the common case, on every batch the warm path takes
            return 0
        changed = 0
        with self.session() as s:
            for event_id, by in pairs:
                query = (
                    update(EventRecord)
                    .where(col(EventRecord.id) == event_id)
                    .where(col(EventRecord.incident_id).is_(None))
                    .where(col(EventRecord.explained_by).is_(None))
                    .values(explained_by=by)
                )
                changed += len(audited(s, query))
            s.commit()
        return changed

    def unassigned_on_switch(self, switch: str, kinds: Iterable[str], since: datetime) -> list[FaultEvent]:
        """Events of these kinds under `switch`, since `since`, that no incident holds yet, oldest
        first: a storm's events that other replicas stored and are still holding."""
        query = (
            select(EventRecord)
            .where(col(EventRecord.incident_id).is_(None))
            .where(EventRecord.switch == switch)
            .where(col(EventRecord.kind).in_(sorted(kinds)))
            .where(col(EventRecord.time) >= since)
            .order_by(col(EventRecord.time), col(EventRecord.id))
        )
        with self.session() as s:
            return [_event_of(r) for r in s.exec(query)]

    def incident_events(self, incident_id: str) -> list[FaultEvent]:
        query = select(EventRecord).where(EventRecord.incident_id == incident_id)
        with self.session() as s:
            return [_event_of(r) for r in s.exec(query.order_by(col(EventRecord.time), col(EventRecord.id)))]

    def events_between(
        self, start: datetime, end: datetime, around: Around | None = None
    ) -> list[FaultEvent]:
        """Every stored event in a time range, or only those `around` takes (`Around.takes`, here in
        SQL): the cluster context for one decision's cross-node rules."""
        query = select(EventRecord).where(col(EventRecord.time) >= start).where(col(EventRecord.time) <= end)
        if around is not None:
            query = query.where(col(EventRecord.kind).in_(sorted(around.kinds)))
            if not around.everywhere:
                slices = [
                    col(column).in_(sorted(values))
                    for column, values in (
                        (EventRecord.node, around.nodes),
                        (EventRecord.job, around.jobs),
                        (EventRecord.switch, around.switches),
                        (EventRecord.iteration, around.iterations),
                    )
                    if values
                ]
                if not slices:
                    return []
                query = query.where(or_(*slices))
        with self.session() as s:
            return [_event_of(r) for r in s.exec(query)]

    def node_history(self, node: str, since: datetime) -> list[FaultEvent]:
        """`remediation` events for a node: reported ones, plus our own successful actions."""
        reported = (
            select(EventRecord)
            .where(EventRecord.node == node)
            .where(EventRecord.kind == "remediation")
            .where(col(EventRecord.time) >= since)
        )
        with self.session() as s:
            history = [_event_of(r) for r in s.exec(reported)]
            ours = succeeded_actions(s, since, node=node)
        history.extend(
            FaultEvent(
                id=f"action-{action.key}",
                time=action.intent_at,
                source="medic",
                kind="remediation",
                node=node,
                attributes={"action": action.action, "incident": action.incident_id},
            )
            for action in ours
            if action.action in NODE_REMEDIATIONS
        )
        return sorted(history, key=lambda e: e.time)


def _event_of(row: EventRecord) -> FaultEvent:
    return FaultEvent.model_validate(
        row.model_dump(exclude={"received_at", "incident_id", "explained_by"}, exclude_none=True)
    )


def _event_values(event: FaultEvent, incident_id: str | None, received_at: datetime) -> dict[str, Any]:
    values = event.model_dump(mode="python", exclude={"kind"})
    return values | {"kind": event.kind.value, "received_at": received_at, "incident_id": incident_id}


def _event_row(event: FaultEvent, incident_id: str | None, received_at: datetime) -> EventRecord:
    return EventRecord(**_event_values(event, incident_id, received_at))
