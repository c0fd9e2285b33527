"""Incidents in the store: opened from correlated events, then updated by their flow run.

The statuses an incident goes through are `medic.statuses.IncidentStatus`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from medic.incidents import DEFAULT_WINDOW, Incident, cleared_stragglers, copies_of_handled, fault_signature
from medic.statuses import ACTIVE_INCIDENT_STATUSES, TERMINAL_INCIDENT_STATUSES, ActionStatus, IncidentStatus
from medic.store.actions import held_nodes
from medic.store.engine import StoreBase, utcnow
from medic.store.ledger import audited
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
        """Create the incident row, or refresh an existing one with its newest events; either way
        its stored events that are in no incident yet are tied to it."""
        with self.session() as s:
            row = s.get(IncidentRecord, incident.id)
            if row is None:
                row = _new_row(incident, owner)
                s.add(row)
                s.commit()
                _tie_events(s, row.id, incident)
            else:
                _join(s, row, incident, owner)
            s.commit()
            return row

    def open_or_join(
        self,
        incident: Incident,
        *,
        runner: str,
        lease_s: float,
        owner: str | None = None,
        window: timedelta = DEFAULT_WINDOW,
    ) -> tuple[IncidentRecord, bool]:
        """Open the incident with its lease held by `runner`, or join its events to the one being
        handled for the same node (switch). Returns (row, True) when the caller opened it and must
        run it; (row, False) when the events joined an incident that is someone's already.

        One active incident per subject is a unique partial index, so two replicas (or an ingest
        beside them) racing to open one get one incident between them; an incident id handled
        before (replayed input) is not opened again, and one whose run failed is run again.
        Events stored while the subject's incident was still active join it even when they reach
        here after it ended (a replica slowed down, a scheduler call that hung): the same fault's
        late duplicates must not open a second incident that acts on the node again. Nor do copies
        that arrive later still, after the incident acted or was handed to people, while the fault's
        burst goes on (`window`) or the incident holds the node: they join it as late evidence
        (docs/decisions/0013), and the incident is not run again.
        """
        while True:
            with self.session() as s:
                row = (
                    _active(s, incident.node, incident.scope)
                    or s.get(IncidentRecord, incident.id)
                    or _ended_after(s, incident, _received(s, incident))
                )
                if row is not None and row.status != IncidentStatus.FAILED:
                    _join(s, row, incident, owner)
                    s.commit()
                    return row, False
                handled = _copies_handled_by(s, incident, window) if row is None else None
                if handled is not None:
                    # Late evidence: tied to the incident for its record, its times left as they were
                    # (the fault it acted on), nothing run again.
                    _tie_events(s, handled.id, incident)
                    s.commit()
                    return handled, False
                if row is None:
                    row = _new_row(incident, owner)
                else:  # its run raised: replayed input runs it again, from the top
                    _join(s, row, incident, owner)
                    row.status = IncidentStatus.OPEN
                row.runner, row.lease_until = runner, utcnow() + timedelta(seconds=lease_s)
                s.add(row)
                try:
                    s.commit()
                except IntegrityError:  # another process opened the subject's incident first: join it
                    s.rollback()
                    continue
                _tie_events(s, row.id, incident)
                s.commit()
                return row, True

    def claim_incident(self, incident_id: str, runner: str, lease_s: float, dead: Iterable[str] = ()) -> bool:
        """Take the lease on an incident still being handled if no live run holds it: none holds
        it, its lease lapsed, or its holder is one of the `dead` runners.

        One conditional update: of two processes picking up the same orphan, one gets it."""
        now = utcnow()
        query = (
            update(IncidentRecord)
            .where(col(IncidentRecord.id) == incident_id)
            .where(col(IncidentRecord.status).in_(sorted(ACTIVE_INCIDENT_STATUSES)))
            .where(_unheld(now, dead))
            .values(runner=runner, lease_until=now + timedelta(seconds=lease_s))
        )
        with self.session() as s:
            taken = len(audited(s, query)) == 1
            s.commit()
            return taken

    def renew_leases(self, runner: str, incident_ids: Iterable[str], lease_s: float) -> int:
        """Extend the leases `runner` holds; returns how many it still holds."""
        ids = list(incident_ids)
        if not ids:
            return 0
        query = (
            update(IncidentRecord)
            .where(col(IncidentRecord.id).in_(ids))
            .where(col(IncidentRecord.runner) == runner)
            .values(lease_until=utcnow() + timedelta(seconds=lease_s))
        )
        with self.session() as s:
            renewed = len(audited(s, query))
            s.commit()
            return renewed

    def incident_runners(self) -> set[str]:
        """The runners holding leases on incidents still being handled."""
        query = (
            select(IncidentRecord.runner)
            .where(col(IncidentRecord.status).in_(sorted(ACTIVE_INCIDENT_STATUSES)))
            .where(col(IncidentRecord.runner).is_not(None))
            .distinct()
        )
        with self.session() as s:
            return {r for r in s.exec(query) if r}

    def orphaned_incidents(self, dead: Iterable[str] = ()) -> list[IncidentRecord]:
        """Incidents still being handled that no live run holds, oldest first."""
        query = (
            select(IncidentRecord)
            .where(col(IncidentRecord.status).in_(sorted(ACTIVE_INCIDENT_STATUSES)))
            .where(_unheld(utcnow(), dead))
            .order_by(col(IncidentRecord.opened_at))
        )
        with self.session() as s:
            return list(s.exec(query))

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


# The node's latest handled incidents a copy is compared with: a copy of an older fault than these is
# a fault that came back after other trouble on the node.
_HANDLED_LOOKED_AT = 3


def _acted(s: Session, incident_id: str) -> bool:
    query = (
        select(ActionRecord.key)
        .where(ActionRecord.incident_id == incident_id)
        .where(ActionRecord.status == ActionStatus.SUCCEEDED)
    )
    return s.exec(query).first() is not None


def _copies_handled_by(s: Session, incident: Incident, window: timedelta) -> IncidentRecord | None:
    """The node's handled incident these events are copies of (`copies_of_handled`), if any: one
    that took a node action or was handed to people. One closed with nothing done is left out: a
    fault judged harmless once is judged again when it repeats (a rule may count its repeats); but
    not a straggler whose verdict cleared the node, which is the same finding again (0024)."""
    if incident.scope != "node":
        return None  # a storm under a switch joins its incident within the window (0006)
    query = (
        select(IncidentRecord)
        .where(IncidentRecord.node == incident.node)
        .where(IncidentRecord.scope == "node")
        .where(col(IncidentRecord.status).in_(sorted(TERMINAL_INCIDENT_STATUSES)))
        .order_by(col(IncidentRecord.closed_at).desc())
        .limit(_HANDLED_LOOKED_AT)
    )
    candidates = list(s.exec(query))
    if not candidates:
        return None
    holder = next((h.incident for h in held_nodes(s, incident.node)), None)
    cleared = cleared_stragglers(incident.events)
    for row in candidates:
        if row.status != IncidentStatus.ESCALATED and not cleared and not _acted(s, row.id):
            continue
        evidence = [
            (fault_signature(kind, gpu, attributes), at)
            for kind, gpu, attributes, at in s.exec(
                select(EventRecord.kind, EventRecord.gpu, EventRecord.attributes, EventRecord.time).where(
                    EventRecord.incident_id == row.id
                )
            )
        ]
        if copies_of_handled(incident.events, evidence, window, held=holder == row.id):
            return row
    return None


def _unheld(now: datetime, dead: Iterable[str]) -> Any:
    return or_(
        col(IncidentRecord.runner).is_(None),
        col(IncidentRecord.runner).in_(list(dead)),
        col(IncidentRecord.lease_until).is_(None),
        col(IncidentRecord.lease_until) < now,
    )


def _active(s: Session, subject: str, scope: str) -> IncidentRecord | None:
    query = (
        select(IncidentRecord)
        .where(IncidentRecord.node == subject)
        .where(IncidentRecord.scope == scope)
        .where(col(IncidentRecord.status).in_(sorted(ACTIVE_INCIDENT_STATUSES)))
    )
    return s.exec(query).first()


def _received(s: Session, incident: Incident) -> datetime | None:
    """When the store first received any of the incident's events (None: none stored yet)."""
    ids = [e.id for e in incident.events]
    if not ids:
        return None
    query = select(func.min(EventRecord.received_at)).where(col(EventRecord.id).in_(ids))
    return s.exec(query).one()


def _ended_after(s: Session, incident: Incident, received: datetime | None) -> IncidentRecord | None:
    """The subject's incident that was handled (closed or escalated) after `received`: the one these
    events would have joined had they been correlated when they arrived."""
    if received is None:
        return None
    query = (
        select(IncidentRecord)
        .where(IncidentRecord.node == incident.node)
        .where(IncidentRecord.scope == incident.scope)
        .where(col(IncidentRecord.status).in_(sorted(TERMINAL_INCIDENT_STATUSES)))
        .where(col(IncidentRecord.closed_at) >= received)
        .order_by(col(IncidentRecord.closed_at).desc())
    )
    return s.exec(query).first()


def _new_row(incident: Incident, owner: str | None) -> IncidentRecord:
    return IncidentRecord(
        id=incident.id,
        node=incident.node,
        scope=incident.scope,
        switch=incident.switch,
        opened_at=incident.opened_at,
        last_event_at=incident.last_at,
        jobs=incident.jobs,
        owner=owner,
    )


def _join(s: Session, row: IncidentRecord, incident: Incident, owner: str | None) -> None:
    """More evidence for an incident: its events are tied to it, its times and jobs widened."""
    row.last_event_at = max(row.last_event_at, incident.last_at)
    row.jobs = sorted(set(row.jobs or []) | set(incident.jobs))
    row.owner = row.owner or owner
    s.add(row)
    _tie_events(s, row.id, incident)


def _tie_events(s: Session, incident_id: str, incident: Incident) -> None:
    ids = [e.id for e in incident.events]
    if ids:
        audited(
            s,
            update(EventRecord)
            .where(col(EventRecord.id).in_(ids))
            .where(col(EventRecord.incident_id).is_(None))
            .values(incident_id=incident_id),
        )
