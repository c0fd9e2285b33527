"""What `medic rollout report` and /metrics read (medic/rollout.py): the decisions on nodes, people's
`node_state` changes and the incidents opened, each as plain records, from a time on (all when None)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlmodel import col, select

from medic.policy.model import Policy
from medic.policy.selectors import OTHER_NODES
from medic.rollout import (
    NO_OVERRIDE,
    DecisionFact,
    Opened,
    Override,
    PeopleChange,
    RolloutReport,
    build_rollout,
    placer,
    policy_thresholds,
)
from medic.store.modes import ModesMixin
from medic.store.tables import DecisionRecord, EventRecord, IncidentRecord

# The report's defaults (docs/rollout.md#the-report): its span, the window after a decision in which
# people's change is its answer, and the days in which the node failing again makes a would-have right.
SINCE = timedelta(days=30)
WINDOW = timedelta(hours=6)
RECURRENCE = timedelta(days=7)


@dataclass(frozen=True, slots=True)
class RolloutRows:
    decisions: list[DecisionFact]
    people: list[PeopleChange]
    opened: list[Opened]


class RolloutMixin(ModesMixin):  # the report says each group's mode now
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

    def rollout_report(
        self,
        policy: Policy,
        *,
        since: datetime | None,
        now: datetime,
        window: timedelta = WINDOW,
        recurrence: timedelta = RECURRENCE,
        override: Override = NO_OVERRIDE,
        group: str | None = None,
    ) -> RolloutReport:
        """The report from `since` on, judged against the policy's readiness thresholds (the override's
        where given), with the misses on nodes GPU Medic never decided on placed by its groups."""
        # From a window earlier: a change early in the span needs the decision or change just before it.
        rows = self.rollout_rows(None if since is None else since - window)
        thresholds = policy_thresholds(policy, override)
        return build_rollout(
            rows.decisions,
            rows.people,
            rows.opened,
            modes_now=self.last_modes(),
            since=since,
            now=now,
            window=window,
            recurrence=recurrence,
            thresholds=thresholds[OTHER_NODES],
            group_thresholds=thresholds,
            placed=placer(policy),
            group=group,
        )
