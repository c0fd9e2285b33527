"""What `medic rollout report` reads (medic/rollout.py): the decisions on nodes, people's `node_state`
changes and the incidents opened, each as plain records, from a time on (all when None)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlmodel import col, select

from medic.rollout import DecisionFact, Opened, PeopleChange
from medic.store.engine import StoreBase
from medic.store.tables import DecisionRecord, EventRecord, IncidentRecord


@dataclass(frozen=True, slots=True)
class RolloutRows:
    decisions: list[DecisionFact]
    people: list[PeopleChange]
    opened: list[Opened]


class RolloutMixin(StoreBase):
    def rollout_rows(self, since: datetime | None) -> RolloutRows:
        """Decisions on incidents of node scope, `node_state` events from Slurm and node incidents."""
        decided = (
            select(DecisionRecord, IncidentRecord.node)
            .join(IncidentRecord, col(IncidentRecord.id) == col(DecisionRecord.incident_id))
            .where(col(IncidentRecord.scope) == "node")
        )
        people = select(EventRecord).where(
            col(EventRecord.kind) == "node_state", col(EventRecord.source) == "slurm"
        )
        opened = select(IncidentRecord).where(col(IncidentRecord.scope) == "node")
        if since is not None:
            decided = decided.where(col(DecisionRecord.decided_at) >= since)
            people = people.where(col(EventRecord.time) >= since)
            opened = opened.where(col(IncidentRecord.opened_at) >= since)
        with self.session() as s:
            return RolloutRows(
                decisions=[
                    DecisionFact(
                        incident=d.incident_id,
                        node=node,
                        at=d.decided_at,
                        action=d.action,
                        mode=d.mode,
                        group=d.node_group,
                        rule=d.rule,
                    )
                    for d, node in s.exec(decided)
                ],
                people=[
                    PeopleChange(
                        id=e.id, node=e.node, at=e.time, change=str((e.attributes or {}).get("change"))
                    )
                    for e in s.exec(people)
                ],
                opened=[Opened(incident=i.id, node=i.node, at=i.opened_at) for i in s.exec(opened)],
            )
