"""The dead letter: input that was not an event, kept verbatim with the reason it was refused."""

from __future__ import annotations

from collections.abc import Iterable

from sqlmodel import col, select

from medic.intake import Rejection
from medic.store.engine import StoreBase, utcnow
from medic.store.tables import RejectedRecord


class RejectionsMixin(StoreBase):
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


def _text(value: str) -> str:
    """PostgreSQL text cannot hold NUL: a dead-lettered line with one must still be kept (as U+FFFD)."""
    return value.replace("\x00", "\ufffd")
