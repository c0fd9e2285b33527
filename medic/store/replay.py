"""What `medic policy replay` reads: the recorded decisions, and the events they were made on.

Read in a few bulk queries of plain columns, not a query per incident nor ORM objects: a replay
covers weeks of a fleet's incidents (docs/policy.md#replay), and building an object per row would
cost more than deciding them again.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from operator import attrgetter
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Select, String, Text, and_, cast, func, or_, select, type_coerce
from sqlmodel import col

from medic.events import EventKind, FaultEvent, validated_event
from medic.facts import HISTORY_WINDOW
from medic.incidents import Scope
from medic.policy.model import Action
from medic.policy.selectors import Mode
from medic.store.events import EventsMixin
from medic.store.tables import BreakerRecord, DecisionRecord, EventRecord, IncidentRecord
from medic.whatif.replay import History, RecordedDecision
from medic.whatif.replay_report import Outcome


def _as_stored(column: Any) -> ColumnElement[Any]:
    """A column as the driver hands it back (SQLite: text; PostgreSQL: datetimes and JSON decoded),
    converted here (`_utc`, `_json`): SQLAlchemy's own conversion of the hundreds of thousands of times
    a replay reads costs several times as much."""
    return type_coerce(col(column), String())


_EVENT_COLUMNS = [
    col(EventRecord.id),
    _as_stored(EventRecord.time),
    *(col(c) for c in (EventRecord.source, EventRecord.kind, EventRecord.node, EventRecord.gpu)),
    *(col(c) for c in (EventRecord.job, EventRecord.rank, EventRecord.iteration, EventRecord.switch)),
    _as_stored(EventRecord.attributes),
    col(EventRecord.incident_id),
]


@dataclass(frozen=True, slots=True)
class ReplaySplit:
    """Where a replay's incidents split in two parts (medic/whatif/replay.py, `decided_as_one`)."""

    incidents: int  # replayed in all
    middle: datetime  # the later part opened from then on


class ReplayMixin(EventsMixin):
    def replay_history(
        self,
        *,
        since: datetime | None,
        lookback: timedelta,
        until: datetime | None = None,
        start: datetime | None = None,
    ) -> History:
        """Every decision on the incidents opened since `since` (all when None) and before `until`,
        oldest first; their incidents' events; and every event from `start` (by default `lookback`
        before the first decision) to the last decision, which the policy's cross-node conditions may
        count."""
        incidents = _opened(select(col(IncidentRecord.id)), since, until)
        with self.engine.connect() as connection:
            # The incidents' columns are joined here, not in SQL: a join looks up the incident of
            # each decision, twice per incident, where one scan of the incidents reads each once.
            opened: dict[str, _Incident] = {
                id_: (node, "switch" if scope == "switch" else "node", run)
                for id_, node, scope, run in connection.execute(_opened(_INCIDENT_COLUMNS, since, until))
            }
            outcomes: dict[tuple[Any, ...], Outcome] = {}
            decisions = [
                _recorded(row, incident, outcomes)
                for row in connection.execute(_decisions(incidents if since or until else None))
                if (incident := opened.get(row[1])) is not None
            ]
            # In the order they were made, sorted here: SQL would sort the rows with their facts (no
            # index holds that order), which costs half as much again as reading them.
            decisions.sort(key=_MADE)
            if not decisions:
                return History(decisions=[], events=[], incident_events={}, remediations={})
            start = start or decisions[0].decided_at - lookback
            end = max(d.decided_at for d in decisions)
            query = select(*_EVENT_COLUMNS).where(
                or_(
                    and_(col(EventRecord.time) >= start, col(EventRecord.time) <= end),
                    and_(col(EventRecord.incident_id).in_(incidents), col(EventRecord.time) < start),
                )
            )
            events: list[FaultEvent] = []
            by_incident: defaultdict[str, list[FaultEvent]] = defaultdict(list)
            for row in connection.execute(query.order_by(col(EventRecord.time), col(EventRecord.id))):
                event = _event(row)
                events.append(event)
                if row[-1] is not None:
                    by_incident[row[-1]].append(event)
            # Every closing, not only those in reach: a handful of rows, the same for every part of a
            # replay (medic/apps/cli/replay_parallel.py).
            closed = list(connection.execute(select(col(BreakerRecord.closed_at))).scalars())
        # The node history only matters for decisions recorded without their facts: rebuilding them.
        old_nodes = {d.node for d in decisions if d.facts is None and d.scope == "node"}
        history_since = start - HISTORY_WINDOW
        remediations = {node: self.node_history(node, history_since) for node in sorted(old_nodes)}
        return History(
            decisions=decisions,
            events=events,
            incident_events=by_incident,
            remediations=remediations,
            breaker_closed_at=[at for at in closed if at is not None],
            start=start,
            end=end,
        )

    def replay_split(self, since: datetime | None, share: float = 0.5) -> ReplaySplit | None:
        """Where the incidents opened since `since` split in two parts, `share` of them (at least one)
        in the earlier; None for fewer than two."""
        opened_at = col(IncidentRecord.opened_at)
        with self.engine.connect() as connection:
            count = connection.execute(
                _opened(select(func.count(col(IncidentRecord.id))), since, None)
            ).scalar_one()
            if count < 2:
                return None
            middle = connection.execute(
                _opened(select(opened_at), since, None)
                .order_by(opened_at)
                .offset(min(max(1, int(count * share)), count - 1))
                .limit(1)
            ).scalar_one()
        return ReplaySplit(count, middle)


_MADE = attrgetter("decided_at", "id")  # of two decisions made at one moment, the one recorded first
_Incident = tuple[str, Scope, str | None]  # what a decision needs of its incident: node, scope, flow run
_Query = TypeVar("_Query", bound=Select[*tuple[Any, ...]])
_INCIDENT_COLUMNS = select(
    col(IncidentRecord.id),
    col(IncidentRecord.node),
    col(IncidentRecord.scope),
    col(IncidentRecord.flow_run_id),
)


def _opened(query: _Query, since: datetime | None, until: datetime | None) -> _Query:
    """`query` over the incidents opened since `since` and before `until` (either may be None)."""
    if since is not None:
        query = query.where(col(IncidentRecord.opened_at) >= since)
    return query if until is None else query.where(col(IncidentRecord.opened_at) < until)


def _decisions(incidents: Select[*tuple[Any, ...]] | None) -> Select[*tuple[Any, ...]]:
    columns = [
        col(DecisionRecord.id),
        col(DecisionRecord.incident_id),
        _as_stored(DecisionRecord.decided_at),
        *(col(c) for c in (DecisionRecord.rule, DecisionRecord.action, DecisionRecord.diagnose_level)),
        col(DecisionRecord.guardrail),
        col(DecisionRecord.mode),
    ]
    # The facts as JSON text: pydantic reads it in one pass (medic.whatif.replay.FactsRecord).
    facts = cast(col(DecisionRecord.facts), Text).label("facts")
    query = select(*columns, facts)
    if incidents is not None:
        query = query.where(col(DecisionRecord.incident_id).in_(incidents))
    return query


def _recorded(row: Any, incident: _Incident, outcomes: dict[tuple[Any, ...], Outcome]) -> RecordedDecision:
    id_, incident_id, decided_at, rule, action, level, guardrail, mode, facts = row
    # Decisions come in few outcomes (a rule, its action and level, the guardrail): one object each.
    key = (rule, action, level, guardrail)
    outcome = outcomes.get(key)
    if outcome is None:
        outcome = outcomes[key] = Outcome(
            rule=rule, action=Action(action), diagnose_level=level, guardrail=guardrail
        )
    node, scope, flow_run_id = incident
    # A decision recorded without facts holds SQL NULL, or JSON null when written through the ORM.
    kept = None if facts is None or facts == "null" else facts
    return RecordedDecision(
        id_, incident_id, node, scope, _utc(decided_at), outcome, kept, flow_run_id, _MODES.get(mode)
    )


_parse_time = datetime.fromisoformat
_MODES = {mode.value: mode for mode in Mode}  # NULL before modes were recorded: None


def _utc(value: str | datetime) -> datetime:
    """A stored time as `UTCDateTime` reads it back: aware, in UTC."""
    if isinstance(value, str):
        try:
            # As SQLAlchemy writes it to SQLite: UTC without an offset. Parsed with one, the time carries
            # the `UTC` object itself, at a sixth of the cost of setting it with `replace`.
            return _parse_time(value + "+00:00")
        except ValueError:  # written with an offset of its own
            value = _parse_time(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _json(value: str | dict[str, Any] | None) -> Any:
    return json.loads(value) if isinstance(value, str) else value


_KINDS = {kind.value: kind for kind in EventKind}
# Stored events were validated when accepted and are kept as FaultEvent dumps them.
_FIELDS_SET = frozenset({"id", "time", "source", "kind", "node", "attributes"})


def _event(row: Any) -> FaultEvent:
    id_, time, source, kind, node, gpu, job, rank, iteration, switch, attributes, _ = row
    return validated_event(
        {
            "id": id_,
            "time": _utc(time),
            "source": source,
            "kind": _KINDS[kind],
            "node": node,
            "gpu": gpu,
            "job": job,
            "rank": rank,
            "iteration": iteration,
            "switch": switch,
            "attributes": _json(attributes) or {},
        },
        _FIELDS_SET,
    )
