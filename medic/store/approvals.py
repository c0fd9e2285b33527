"""Requests for a human's approval and their answers: who, when, through what.

An answer of None (`approved=None`) is no answer: the request timed out.
"""

from __future__ import annotations

from sqlalchemy import update
from sqlmodel import col, select

from medic.store.engine import StoreBase, utcnow
from medic.store.ledger import audited
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

    def claim_answer(
        self, incident_id: str, *, approved: bool, by: str, via: str
    ) -> tuple[ApprovalRecord | None, bool]:
        """Answer the incident's open request, if it is still open: the first answer wins.

        One conditional UPDATE, so two clicks at the same moment (two replicas, two people) give
        one winner. Returns (the request as it now stands, True when this answer was the one
        written); (None, False) when the incident has no request at all."""
        with self.session() as s:
            won = (
                len(
                    audited(
                        s,
                        update(ApprovalRecord)
                        .where(col(ApprovalRecord.incident_id) == incident_id)
                        .where(col(ApprovalRecord.answered_at).is_(None))
                        .values(answered_at=utcnow(), approved=approved, by=by, via=via),
                    )
                )
                > 0
            )
            s.commit()
        requests = self.approvals(incident_id)
        return (requests[-1] if requests else None), won

    def reopen_approval(self, row_id: int) -> None:
        """Take a claimed answer back, when it could not be delivered to the waiting run."""
        with self.session() as s:
            audited(
                s,
                update(ApprovalRecord)
                .where(col(ApprovalRecord.id) == row_id)
                .values(answered_at=None, approved=None, by=None, via=None),
            )
            s.commit()

    def approvals(self, incident_id: str) -> list[ApprovalRecord]:
        with self.session() as s:
            query = select(ApprovalRecord).where(ApprovalRecord.incident_id == incident_id)
            return list(s.exec(query.order_by(col(ApprovalRecord.id))))
