"""The circuit breaker: opened by a storm, closed only by a human.

At most one opening is current (no `closed_at`), enforced by a unique partial index so that
replicas opening it at once make one row; opening it again while it is open returns that one,
and the history of openings stays.
"""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlmodel import col, select

from medic.store.engine import StoreBase, utcnow
from medic.store.tables import BreakerRecord

_CURRENT = select(BreakerRecord).where(col(BreakerRecord.closed_at).is_(None))


class BreakerMixin(StoreBase):
    def open_breaker(self, reason: str, incident_id: str | None = None) -> BreakerRecord:
        with self.session() as s:
            current = s.exec(_CURRENT).first()
            if current is not None:
                return current
            row = BreakerRecord(opened_at=utcnow(), reason=reason, incident_id=incident_id)
            s.add(row)
            try:
                s.commit()
                return row
            except IntegrityError:  # another replica opened it between our look and our insert
                s.rollback()
        with self.session() as s:
            return s.exec(_CURRENT).one()

    def open_breaker_record(self) -> BreakerRecord | None:
        with self.session() as s:
            return s.exec(_CURRENT).first()

    def close_breaker(self, by: str) -> BreakerRecord | None:
        with self.session() as s:
            row = s.exec(_CURRENT).first()
            if row is None:
                return None
            row.closed_at, row.closed_by = utcnow(), by
            s.add(row)
            s.commit()
            return row
