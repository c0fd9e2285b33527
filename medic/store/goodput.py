"""What each incident cost each job (medic/goodput.py), written when the incident closes.

One row per (incident, job): writing it again (a retried close) replaces it.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlmodel import col, select

from medic.store.engine import StoreBase
from medic.store.tables import GoodputRecord


class GoodputMixin(StoreBase):
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
