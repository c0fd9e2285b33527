"""The outbox: chat messages kept from the moment a flow says them until they are delivered or given
up (medic/tasks/notify.py), so that a process that stops or dies does not take them along.

A pending message is held by the process sending it (`owner`) until `lease_until`, renewed while it
tries. Another process claims a dead owner's messages all at once, by one conditional UPDATE (like
an incident's lease, medic/store/incidents.py): of two replicas claiming together, one gets them,
so each message goes on with one process, and a message and its replies with the same one.

Not audited (medic/store/chain.py): what a message came to is its `notify` or `update` step, which
`settle_message` writes in the same transaction as the row's status.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from sqlalchemy import func, or_, update
from sqlmodel import SQLModel, col, select

from medic.statuses import MessageStatus
from medic.store.engine import StoreBase, utcnow
from medic.store.tables import OutboxRecord, StepRecord

_TABLE = SQLModel.metadata.tables[OutboxRecord.__tablename__]


class OutboxMixin(StoreBase):
    def queue_message(
        self,
        incident_id: str,
        stage: str,
        *,
        message: dict[str, Any] | None,
        text: str,
        parent_id: int | None,
        owner: str,
        lease_s: float,
    ) -> int:
        """Keep a message said, pending and held by `owner`; returns its row's id."""
        now = utcnow()
        row = OutboxRecord(
            incident_id=incident_id,
            stage=stage,
            message=message,
            text=text,
            parent_id=parent_id,
            status=MessageStatus.PENDING,
            owner=owner,
            lease_until=now + timedelta(seconds=lease_s),
            created_at=now,
        )
        with self.session() as s:
            s.add(row)
            s.commit()
            assert row.id is not None
            return row.id

    def note_try(self, row_id: int, tries: int, error: str) -> None:
        """A try that failed: the message stays pending."""
        query = update(OutboxRecord).where(col(OutboxRecord.id) == row_id).values(tries=tries, error=error)
        with self.session() as s:
            s.execute(query)
            s.commit()

    def settle_message(
        self, row_id: int, status: str, *, tries: int, error: str, ref: str | None, step: StepRecord
    ) -> None:
        """Delivered or given up, with the step that says so, in one transaction: a message is never
        recorded as delivered and still pending. A row another process settled first keeps what it
        says; the step is written all the same (both sent it)."""
        query = (
            update(OutboxRecord)
            .where(col(OutboxRecord.id) == row_id)
            .where(col(OutboxRecord.status) == MessageStatus.PENDING)
            .values(status=status, tries=tries, error=error, ref=ref, settled_at=utcnow())
        )
        with self.session() as s:
            s.execute(query)
            s.add(step)
            s.commit()

    def renew_messages(self, owner: str, lease_s: float) -> None:
        """Extend `owner`'s hold on its pending messages."""
        query = (
            update(OutboxRecord)
            .where(col(OutboxRecord.owner) == owner)
            .where(col(OutboxRecord.status) == MessageStatus.PENDING)
            .values(lease_until=utcnow() + timedelta(seconds=lease_s))
        )
        with self.session() as s:
            s.execute(query)
            s.commit()

    def message_owners(self) -> set[str]:
        """The processes holding pending messages."""
        query = (
            select(OutboxRecord.owner)
            .where(col(OutboxRecord.status) == MessageStatus.PENDING)
            .where(col(OutboxRecord.owner).is_not(None))
            .distinct()
        )
        with self.session() as s:
            return {o for o in s.exec(query) if o}

    def claim_messages(self, owner: str, lease_s: float, dead: Iterable[str] = ()) -> list[OutboxRecord]:
        """Take the pending messages of every other process that is gone: one of the `dead`, or
        one whose holds have all lapsed. Returns them in the order they were said.

        A process is judged by all of its messages at once, so its messages move together: a reply
        is never claimed apart from the message it replies to."""
        now = utcnow()
        lapsed = (
            select(OutboxRecord.owner)
            .where(col(OutboxRecord.status) == MessageStatus.PENDING)
            .group_by(col(OutboxRecord.owner))
            .having(func.max(OutboxRecord.lease_until) < now)
        )
        query = (
            update(OutboxRecord)
            .where(col(OutboxRecord.status) == MessageStatus.PENDING)
            .where(col(OutboxRecord.owner) != owner)
            .where(or_(col(OutboxRecord.owner).in_(sorted(dead)), col(OutboxRecord.owner).in_(lapsed)))
            .values(owner=owner, lease_until=now + timedelta(seconds=lease_s))
            .returning(*_TABLE.c)
        )
        with self.session() as s:
            claimed = [OutboxRecord.model_validate(dict(row)) for row in s.execute(query).mappings()]
            s.commit()
        return sorted(claimed, key=lambda r: r.id or 0)

    def messages(self, row_ids: Iterable[int]) -> list[OutboxRecord]:
        """The rows among `row_ids` that exist, by id."""
        query = select(OutboxRecord).where(col(OutboxRecord.id).in_(sorted(set(row_ids))))
        with self.session() as s:
            return list(s.exec(query))
