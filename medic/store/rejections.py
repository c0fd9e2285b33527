"""The dead letter: input that was not an event, kept verbatim with the reason it was refused.

A flood of bad input keeps a sample, not a row per item (docs/events.md#rejected-lines-dead-letters):
at most `DEAD_LETTER_SAMPLE` rows per request or file, and at most `DEAD_LETTER_PER_MINUTE` rows
per source in any minute. Every rejection, kept or not, is counted in `rejection_counts` by source
and reason class, so a flood is bounded in rows and still accounted for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from sqlalchemy import Executable, bindparam, func, insert, or_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlmodel import SQLModel, col, select

from medic.intake import Rejection, RejectionSample, reason_class, rejection_source
from medic.store.engine import StoreBase, utcnow
from medic.store.tables import RejectedRecord, RejectionCountRecord

DEAD_LETTER_PER_MINUTE = 1000
RATE_WINDOW = timedelta(minutes=1)
# Core statements, built once: a request with one bad item must cost about what it did before
# the dead letter was bounded (ORM statements built per call cost it several times more).
_REJECTED = SQLModel.metadata.tables["rejected_events"]
_COUNTS = SQLModel.metadata.tables["rejection_counts"]
_KEPT_SINCE = (
    select(func.count())
    .select_from(_REJECTED)
    .where(_REJECTED.c.received_at >= bindparam("since"))
    .where(
        or_(
            _REJECTED.c.origin == bindparam("source"),
            _REJECTED.c.origin.like(bindparam("prefix"), escape="\\"),
        )
    )
)
_ADD_TO_COUNT = (
    update(_COUNTS)
    .where(_COUNTS.c.source == bindparam("key_source"), _COUNTS.c.reason_class == bindparam("key_reason"))
    .values(
        rejected=_COUNTS.c.rejected + bindparam("add_rejected"),
        kept=_COUNTS.c.kept + bindparam("add_kept"),
        last_seen=bindparam("now"),
    )
)
# Both stores GPU Medic runs on add to a counter in one statement, so concurrent writers never race.
_UPSERT: dict[str, Any] = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}


@dataclass(frozen=True, slots=True)
class DeadLettered:
    rejected: int  # every rejection offered
    kept: int  # of them, written verbatim to rejected_events; the rest are only counted


class RejectionsMixin(StoreBase):
    def record_rejections(self, rejections: Iterable[Rejection]) -> int:
        """Dead-letter `rejections` (a sample of a flood: `dead_letter`); returns how many there were."""
        return self.dead_letter(RejectionSample.of(rejections)).rejected

    def dead_letter(self, sample: RejectionSample, per_minute: int = DEAD_LETTER_PER_MINUTE) -> DeadLettered:
        """Keep the sample's rejections verbatim while their source has room in the last minute,
        and count every rejection of the sample, kept or not (one transaction)."""
        if not sample.total:
            return DeadLettered(0, 0)
        now = utcnow()
        with self.session() as s:
            connection = s.connection()
            room: dict[str, int] = {}
            kept: list[Rejection] = []
            for rejection in sample.kept:
                source = rejection_source(rejection.origin)
                if source not in room:
                    room[source] = per_minute - _kept_since(connection, source, now - RATE_WINDOW)
                if room[source] > 0:
                    room[source] -= 1
                    kept.append(rejection)
            if kept:
                rows = [
                    {
                        "received_at": now,
                        "origin": _text(r.origin),
                        "raw": _text(r.raw),
                        "reason": _text(r.reason),
                    }
                    for r in kept
                ]
                connection.execute(insert(_REJECTED), rows)
            kept_by = Counter((rejection_source(r.origin), reason_class(r.reason)) for r in kept)
            counts = [
                {
                    "source": _text(source),
                    "reason_class": reason,
                    "rejected": count,
                    "kept": kept_by[source, reason],
                    "first_seen": now,
                    "last_seen": now,
                }
                # In one order in every transaction: two writers of the same counters cannot deadlock.
                for (source, reason), count in sorted(sample.counts.items())
            ]
            upsert = _upsert(connection.dialect.name)
            if upsert is not None:
                connection.execute(upsert, counts)
            else:
                _count_one_by_one(connection, counts, now)
            s.commit()
        return DeadLettered(sample.total, len(kept))

    def rejections(self) -> list[RejectedRecord]:
        with self.session() as s:
            return list(s.exec(select(RejectedRecord).order_by(col(RejectedRecord.id))))

    def rejection_counts(self) -> list[RejectionCountRecord]:
        query = select(RejectionCountRecord).order_by(
            col(RejectionCountRecord.source), col(RejectionCountRecord.reason_class)
        )
        with self.session() as s:
            return list(s.exec(query))


def _kept_since(connection: Connection, source: str, since: datetime) -> int:
    """Rows of `source` written to the dead letter since `since` (its origins are `source[:position]`)."""
    escaped = source.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    params = {"since": since, "source": source, "prefix": f"{escaped}:%"}
    return int(connection.execute(_KEPT_SINCE, params).scalar_one())


@cache
def _upsert(dialect: str) -> Executable | None:
    """Add to a counter, or write it: one statement where the database has ON CONFLICT."""
    make = _UPSERT.get(dialect)
    if make is None:
        return None
    statement = make(_COUNTS)
    return statement.on_conflict_do_update(
        index_elements=["source", "reason_class"],
        set_={
            "rejected": _COUNTS.c.rejected + statement.excluded.rejected,
            "kept": _COUNTS.c.kept + statement.excluded.kept,
            "last_seen": statement.excluded.last_seen,
        },
    )


def _count_one_by_one(connection: Connection, counts: list[dict[str, Any]], now: datetime) -> None:
    """Any other database: add to each row, or write it (two writers racing on a new row may collide)."""
    for values in counts:
        added = connection.execute(
            _ADD_TO_COUNT,
            {
                "key_source": values["source"],
                "key_reason": values["reason_class"],
                "add_rejected": values["rejected"],
                "add_kept": values["kept"],
                "now": now,
            },
        )
        if not added.rowcount:
            connection.execute(insert(_COUNTS), values)


def _text(value: str) -> str:
    """What a dead letter keeps of a rejected text, whatever its characters: PostgreSQL text cannot hold
    NUL (kept as U+FFFD), and neither store can hold a lone surrogate, which is not UTF-8 (a JSON body's
    `\\ud800` decodes to one): kept as its escape, `\\ud800`, so the item is stored, not lost to a 500."""
    return value.replace("\x00", "\ufffd").encode("utf-8", "backslashreplace").decode("utf-8")
