"""The store: every event, rejection, decision, diagnostic, action and stage, on any SQLAlchemy URL."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy import func, insert, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, SQLModel, col, create_engine, select

from medic.events import FaultEvent
from medic.incidents import Incident
from medic.intake import Rejection
from medic.policy.model import Decision
from medic.store.tables import (
    ActionRecord,
    ApprovalRecord,
    BreakerRecord,
    DecisionRecord,
    DiagnosticRecord,
    EventRecord,
    GoodputRecord,
    IncidentRecord,
    RejectedRecord,
    StepRecord,
)

# Actions that count as a remediation in a node's history (drains and resumes do not).
NODE_REMEDIATIONS = frozenset({"reset_gpu", "reboot", "replace"})


def utcnow() -> datetime:
    return datetime.now(UTC)


def _sqlite_pragmas(engine: Engine) -> None:
    # WAL: concurrent readers while a flow writes, and ~5x faster single-row commits.
    @sa_event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=10000")
        cursor.close()


@dataclass(frozen=True, slots=True)
class IncidentDetail:
    incident: IncidentRecord
    events: list[EventRecord]
    steps: list[StepRecord]
    diagnostics: list[DiagnosticRecord]
    decisions: list[DecisionRecord]
    actions: list[ActionRecord]


class Store:
    def __init__(self, url: str) -> None:
        self.url = url
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.engine = create_engine(url, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            _sqlite_pragmas(self.engine)
        SQLModel.metadata.create_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session:
            yield session

    # --- events ---------------------------------------------------------------------------

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
                    s.exec(insert(EventRecord), params=[_event_values(e, None, received_at) for e in fresh])
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
                changed += s.exec(query).rowcount
            s.commit()
        return changed

    def undispatched_events(self) -> list[FaultEvent]:
        """Accepted events no incident holds yet (a node's remediation history aside), oldest first."""
        query = (
            select(EventRecord)
            .where(col(EventRecord.incident_id).is_(None))
            .where(EventRecord.kind != "remediation")
            .order_by(col(EventRecord.time), col(EventRecord.id))
        )
        with self.session() as s:
            return [_event_of(r) for r in s.exec(query)]

    def incident_events(self, incident_id: str) -> list[FaultEvent]:
        query = select(EventRecord).where(EventRecord.incident_id == incident_id)
        with self.session() as s:
            return [_event_of(r) for r in s.exec(query.order_by(col(EventRecord.time), col(EventRecord.id)))]

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
        for action in self.node_actions(node, since):
            if action.action not in NODE_REMEDIATIONS:
                continue
            history.append(
                FaultEvent(
                    id=f"action-{action.key}",
                    time=action.intent_at,
                    source="medic",
                    kind="remediation",
                    node=node,
                    attributes={"action": action.action, "incident": action.incident_id},
                )
            )
        return sorted(history, key=lambda e: e.time)

    def record_rejections(self, rejections: Iterable[Rejection]) -> int:
        now = utcnow()
        rows = [
            RejectedRecord(received_at=now, origin=_text(r.origin), raw=_text(r.raw), reason=_text(r.reason))
            for r in rejections
        ]
        with self.session() as s:
            s.add_all(rows)
            s.commit()
        return len(rows)

    def rejections(self) -> list[RejectedRecord]:
        with self.session() as s:
            return list(s.exec(select(RejectedRecord).order_by(col(RejectedRecord.id))))

    # --- incidents ------------------------------------------------------------------------

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

    def count(self, table: type[SQLModel]) -> int:
        with self.session() as s:
            return s.exec(select(func.count()).select_from(table)).one()

    def ping(self) -> None:
        """Raise unless the database answers."""
        with self.engine.connect() as connection:
            connection.execute(text("SELECT 1"))

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

    # --- what each stage did ----------------------------------------------------------------

    def add_step(
        self,
        incident_id: str,
        stage: str,
        started_at: datetime,
        status: str,
        summary: str,
        detail: dict[str, Any] | None = None,
    ) -> StepRecord:
        row = StepRecord(
            incident_id=incident_id,
            stage=stage,
            started_at=started_at,
            finished_at=utcnow(),
            status=status,
            summary=summary,
            detail=detail,
        )
        with self.session() as s:
            s.add(row)
            s.commit()
        return row

    def add_diagnostic(self, row: DiagnosticRecord) -> DiagnosticRecord:
        with self.session() as s:
            s.add(row)
            s.commit()
        return row

    def add_decision(self, decision: Decision, policy_path: str) -> DecisionRecord:
        row = DecisionRecord(
            incident_id=decision.incident,
            decided_at=utcnow(),
            policy_path=policy_path,
            policy_sha256=decision.policy_sha256,
            rule=decision.rule,
            classification=decision.classification.value,
            action=decision.action.value,
            diagnose_level=decision.diagnose_level,
            reason=decision.reason,
            matched=decision.matched,
            recommend=decision.recommend,
            guardrail=decision.guardrail,
            blocked_action=decision.blocked_action.value if decision.blocked_action else None,
        )
        with self.session() as s:
            s.add(row)
            s.commit()
        return row

    # --- actions: intent before, outcome after ------------------------------------------------

    def claim_action(self, key: str, incident_id: str, node: str, action: str) -> tuple[ActionRecord, bool]:
        """Write the intent. Returns (row, True) for a new claim, or for a failed one taken back
        to try again; (existing row, False) otherwise.

        The unique key makes this safe across processes: two flow runs racing for the same
        fault get one claim between them.
        """
        with self.session() as s:
            existing = s.exec(select(ActionRecord).where(ActionRecord.key == key)).first()
            if existing is not None:
                if existing.status != "failed":
                    return existing, False
                # The call raised: it is tried again, and taking the claim back is one
                # conditional update, so two retrying runs still get one claim between them.
                retake = (
                    update(ActionRecord)
                    .where(col(ActionRecord.key) == key)
                    .where(col(ActionRecord.status) == "failed")
                    .values(status="intent", intent_at=utcnow())
                )
                taken = s.exec(retake).rowcount == 1  # type: ignore[call-overload]
                s.commit()
                s.expire_all()
                return s.exec(select(ActionRecord).where(ActionRecord.key == key)).one(), taken
            row = ActionRecord(
                key=key,
                incident_id=incident_id,
                node=node,
                action=action,
                status="intent",
                intent_at=utcnow(),
            )
            s.add(row)
            try:
                s.commit()
            except IntegrityError:
                s.rollback()
                return s.exec(select(ActionRecord).where(ActionRecord.key == key)).one(), False
            return row, True

    def unfinished_actions(self) -> list[ActionRecord]:
        """Intents without an outcome: a process died between the call and its record."""
        with self.session() as s:
            return list(s.exec(select(ActionRecord).where(ActionRecord.status == "intent")))

    def get_action(self, key: str) -> ActionRecord | None:
        with self.session() as s:
            return s.exec(select(ActionRecord).where(ActionRecord.key == key)).first()

    def finish_action(self, key: str, status: str, detail: str = "", attempts: int = 1) -> ActionRecord:
        with self.session() as s:
            row = s.exec(select(ActionRecord).where(ActionRecord.key == key)).one()
            row.status = status
            row.detail = detail
            row.attempts += attempts
            row.finished_at = utcnow()
            s.add(row)
            s.commit()
            return row

    def actions_since(self, since: datetime, actions: Iterable[str]) -> list[ActionRecord]:
        """Our successful actions of these kinds on any node since a time, oldest first."""
        query = (
            select(ActionRecord)
            .where(col(ActionRecord.action).in_(list(actions)))
            .where(ActionRecord.status == "succeeded")
            .where(col(ActionRecord.intent_at) >= since)
            .order_by(col(ActionRecord.intent_at))
        )
        with self.session() as s:
            return list(s.exec(query))

    def events_between(self, start: datetime, end: datetime) -> list[FaultEvent]:
        """Every stored event in a time range: the cluster context for cross-node rules."""
        query = select(EventRecord).where(col(EventRecord.time) >= start).where(col(EventRecord.time) <= end)
        with self.session() as s:
            return [_event_of(r) for r in s.exec(query)]

    # --- goodput -------------------------------------------------------------------------------

    def record_goodput(self, rows: Iterable[GoodputRecord]) -> None:
        with self.session() as s:
            for row in rows:
                existing = s.exec(
                    select(GoodputRecord)
                    .where(GoodputRecord.incident_id == row.incident_id)
                    .where(GoodputRecord.job == row.job)
                ).first()
                if existing is not None:
                    s.delete(existing)
                    s.flush()
                s.add(row)
            s.commit()

    def goodput(self, job: str | None = None) -> list[GoodputRecord]:
        query = select(GoodputRecord).order_by(col(GoodputRecord.fault_at))
        if job:
            query = query.where(GoodputRecord.job == job)
        with self.session() as s:
            return list(s.exec(query))

    # --- approvals -----------------------------------------------------------------------------

    def request_approval(self, incident_id: str, action: str) -> ApprovalRecord:
        row = ApprovalRecord(incident_id=incident_id, action=action, requested_at=utcnow())
        with self.session() as s:
            s.add(row)
            s.commit()
        return row

    def answer_approval(
        self, row_id: int, *, approved: bool | None, by: str | None, via: str, comment: str = ""
    ) -> None:
        with self.session() as s:
            row = s.get(ApprovalRecord, row_id)
            if row is None:
                raise KeyError(row_id)
            row.answered_at, row.approved, row.by, row.via, row.comment = utcnow(), approved, by, via, comment
            s.add(row)
            s.commit()

    def approvals(self, incident_id: str) -> list[ApprovalRecord]:
        with self.session() as s:
            query = select(ApprovalRecord).where(ApprovalRecord.incident_id == incident_id)
            return list(s.exec(query.order_by(col(ApprovalRecord.id))))

    # --- the circuit breaker: opened by a storm, closed only by a human ---------------------

    def open_breaker(self, reason: str, incident_id: str | None = None) -> BreakerRecord:
        with self.session() as s:
            current = s.exec(select(BreakerRecord).where(col(BreakerRecord.closed_at).is_(None))).first()
            if current is not None:
                return current
            row = BreakerRecord(opened_at=utcnow(), reason=reason, incident_id=incident_id)
            s.add(row)
            s.commit()
            return row

    def open_breaker_record(self) -> BreakerRecord | None:
        with self.session() as s:
            return s.exec(select(BreakerRecord).where(col(BreakerRecord.closed_at).is_(None))).first()

    def close_breaker(self, by: str) -> BreakerRecord | None:
        with self.session() as s:
            row = s.exec(select(BreakerRecord).where(col(BreakerRecord.closed_at).is_(None))).first()
            if row is None:
                return None
            row.closed_at, row.closed_by = utcnow(), by
            s.add(row)
            s.commit()
            return row

    def node_actions(self, node: str, since: datetime) -> list[ActionRecord]:
        """Our successful actions on a node since a time: its remediation history."""
        query = (
            select(ActionRecord)
            .where(ActionRecord.node == node)
            .where(ActionRecord.status == "succeeded")
            .where(col(ActionRecord.intent_at) >= since)
            .order_by(col(ActionRecord.intent_at))
        )
        with self.session() as s:
            return list(s.exec(query))


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def _text(value: str) -> str:
    """PostgreSQL text cannot hold NUL: a dead-lettered line with one must still be kept (as U+FFFD)."""
    return value.replace("\x00", "\ufffd")


def _event_of(row: EventRecord) -> FaultEvent:
    return FaultEvent.model_validate(
        row.model_dump(exclude={"received_at", "incident_id"}, exclude_none=True)
    )


def _event_values(event: FaultEvent, incident_id: str | None, received_at: datetime) -> dict[str, Any]:
    values = event.model_dump(mode="python", exclude={"kind"})
    return values | {"kind": event.kind.value, "received_at": received_at, "incident_id": incident_id}


def _event_row(event: FaultEvent, incident_id: str | None, received_at: datetime) -> EventRecord:
    return EventRecord(**_event_values(event, incident_id, received_at))
