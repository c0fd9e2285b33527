"""Requests for a human's approval and their answers: who, when, through what.

An answer of None (`approved=None`) is no answer: the request timed out.
"""

from __future__ import annotations

from sqlmodel import col, select

from medic.store.engine import StoreBase, utcnow
from medic.store.tables import ApprovalRecord


class ApprovalsMixin(StoreBase):
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
