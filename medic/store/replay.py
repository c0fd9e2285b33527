"""What `medic policy replay` reads: the recorded decisions, and the events they were made on.

Read in a few bulk queries, not a query per incident: a replay covers weeks of a fleet's
incidents (docs/policy.md#replay).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, Text, and_, cast, or_, select
from sqlmodel import col

from medic.events import EventKind, FaultEvent
from medic.facts import HISTORY_WINDOW
from medic.policy.model import Action, Classification, Decision
from medic.policy.replay import History, RecordedDecision
from medic.store.events import EventsMixin
from medic.store.tables import BreakerRecord, DecisionRecord, EventRecord, IncidentRecord

# Columns, not ORM objects: building a row object per event would cost more than the replay itself.
_EVENT_COLUMNS = [
    col(c)
    for c in (
        EventRecord.id,
        EventRecord.time,
        EventRecord.source,
        EventRecord.kind,
        EventRecord.node,
        EventRecord.gpu,
        EventRecord.job,
        EventRecord.rank,
        EventRecord.iteration,
        EventRecord.switch,
        EventRecord.attributes,
        EventRecord.incident_id,
    )
]


class ReplayMixin(EventsMixin):
    def replay_history(self, *, since: datetime | None, lookback: timedelta) -> History:
        """Every decision on the incidents opened since `since` (all when None), oldest first; their
        incidents' events; and every event from `lookback` before the first decision to the last,
        which the policy's cross-node conditions may count."""
        incidents = select(col(IncidentRecord.id))
        if since is not None:
            incidents = incidents.where(col(IncidentRecord.opened_at) >= since)
        with self.engine.connect() as connection:
            decisions = [_recorded(row) for row in connection.execute(_decisions(since))]
            if not decisions:
                return History(decisions=[], events=[], incident_events={}, remediations={})
            start = decisions[0].decided_at - lookback
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
                if row.incident_id is not None:
                    by_incident[row.incident_id].append(event)
            closings = select(col(BreakerRecord.closed_at)).where(col(BreakerRecord.closed_at) >= start)
            closed = list(connection.execute(closings).scalars())
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
        )


def _decisions(since: datetime | None) -> Select[*tuple[Any, ...]]:
    columns = [
        col(c)
        for c in (
            DecisionRecord.incident_id,
            DecisionRecord.decided_at,
            DecisionRecord.rule,
            DecisionRecord.classification,
            DecisionRecord.action,
            DecisionRecord.diagnose_level,
            DecisionRecord.reason,
            DecisionRecord.guardrail,
            DecisionRecord.blocked_action,
            DecisionRecord.policy_sha256,
            IncidentRecord.node,
            IncidentRecord.scope,
            IncidentRecord.flow_run_id,
        )
    ]
    # The facts as JSON text: pydantic reads it in one pass (medic.policy.replay.FactsRecord).
    facts = cast(col(DecisionRecord.facts), Text).label("facts")
    query = select(*columns, facts).join(
        IncidentRecord, col(IncidentRecord.id) == col(DecisionRecord.incident_id)
    )
    if since is not None:
        query = query.where(col(IncidentRecord.opened_at) >= since)
    return query.order_by(col(DecisionRecord.decided_at), col(DecisionRecord.id))


def _recorded(row: Any) -> RecordedDecision:
    decision = Decision(
        incident=row.incident_id,
        classification=Classification(row.classification),
        action=Action(row.action),
        diagnose_level=row.diagnose_level,
        rule=row.rule,
        reason=row.reason,
        policy_sha256=row.policy_sha256,
        guardrail=row.guardrail,
        blocked_action=Action(row.blocked_action) if row.blocked_action else None,
    )
    return RecordedDecision(
        incident=row.incident_id,
        node=row.node,
        scope="switch" if row.scope == "switch" else "node",
        decided_at=row.decided_at,
        decision=decision,
        # A decision recorded without facts holds SQL NULL, or JSON null when written through the ORM.
        facts=None if row.facts in (None, "null") else row.facts,
        flow_run_id=row.flow_run_id,
    )


def _event(row: Any) -> FaultEvent:
    # Validated when accepted, before they were stored; the store holds them as FaultEvent dumps them.
    return FaultEvent.model_construct(
        id=row.id,
        time=row.time,
        source=row.source,
        kind=EventKind(row.kind),
        node=row.node,
        gpu=row.gpu,
        job=row.job,
        rank=row.rank,
        iteration=row.iteration,
        switch=row.switch,
        attributes=row.attributes or {},
    )
