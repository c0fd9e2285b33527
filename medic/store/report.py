"""What `medic report` reads: the incidents opened in a window, and of their events, actions,
approvals and goodput only what the report's figures need (medic/report.py).

Five queries over the whole window, grouped in the database, not a query per incident (a report
covers a fleet's week or month), and one for the nodes held now (`held_nodes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func
from sqlmodel import col, select

from medic.holds import Hold
from medic.store.actions import held_nodes
from medic.store.engine import StoreBase
from medic.store.tables import ActionRecord, ApprovalRecord, EventRecord, GoodputRecord, IncidentRecord


@dataclass(frozen=True, slots=True)
class Touch:
    """Evidence of one incident from one node (and GPU: None for node-wide events), first seen at."""

    incident_id: str
    node: str
    gpu: int | None
    first_at: datetime


@dataclass(frozen=True, slots=True)
class ReportRows:
    incidents: list[IncidentRecord]  # oldest first
    touches: list[Touch]
    # Per incident with any node action: the earliest outcome, or intent while it has none yet.
    first_actions: dict[str, datetime]
    approvals: list[ApprovalRecord]  # oldest request first
    goodput: list[GoodputRecord]
    held: list[Hold]  # now, whatever the window


class ReportMixin(StoreBase):
    def report_rows(self, since: datetime | None) -> ReportRows:
        """Everything `medic report` needs about the incidents opened since `since` (all when None)."""
        window = select(col(IncidentRecord.id))
        if since is not None:
            window = window.where(col(IncidentRecord.opened_at) >= since)

        def of_window(column: Any) -> Any:
            return col(column).in_(window)

        touches = (
            select(EventRecord.incident_id, EventRecord.node, EventRecord.gpu, func.min(EventRecord.time))
            .where(of_window(EventRecord.incident_id))
            .group_by(col(EventRecord.incident_id), col(EventRecord.node), col(EventRecord.gpu))
        )
        acted = (
            select(
                ActionRecord.incident_id,
                func.min(func.coalesce(ActionRecord.finished_at, ActionRecord.intent_at)),
            )
            .where(of_window(ActionRecord.incident_id))
            .group_by(col(ActionRecord.incident_id))
        )
        with self.session() as s:
            incidents = s.exec(
                select(IncidentRecord)
                .where(of_window(IncidentRecord.id))
                .order_by(col(IncidentRecord.opened_at), col(IncidentRecord.id))
            )
            approvals = s.exec(
                select(ApprovalRecord)
                .where(of_window(ApprovalRecord.incident_id))
                .order_by(col(ApprovalRecord.requested_at), col(ApprovalRecord.id))
            )
            goodput = s.exec(
                select(GoodputRecord)
                .where(of_window(GoodputRecord.incident_id))
                .order_by(col(GoodputRecord.fault_at), col(GoodputRecord.id))
            )
            return ReportRows(
                incidents=list(incidents),
                touches=[Touch(i, node, gpu, at) for i, node, gpu, at in s.exec(touches) if i is not None],
                first_actions={i: at for i, at in s.exec(acted)},
                approvals=list(approvals),
                goodput=list(goodput),
                held=held_nodes(s),
            )
