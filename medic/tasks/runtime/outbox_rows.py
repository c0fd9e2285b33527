"""Chat messages kept in the store's outbox (medic/store/outbox.py) while a process tries to send them:
each message's row, this process's hold on its rows, each failed try, and the step that says what
became of it (medic/tasks/notify.py sends them)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from pydantic import TypeAdapter

from medic.protocols import Message
from medic.statuses import MessageStatus, StepStatus
from medic.store import Store, utcnow
from medic.store.tables import OutboxRecord, StepRecord
from medic.tasks.runtime.runners import runner_name
from medic.tasks.runtime.stage import run_logger

# How long this process holds the messages it keeps in the outbox without renewing the hold. It is
# renewed before a try once a third of it has passed: a try (within the notifier's own bound, 40 s
# for Slack) and the pause before the next (at most 30 s) fit in the rest.
LEASE_S = 180.0
# A message pending this long is given up rather than sent (a day-old incident's news misleads).
MAX_AGE = timedelta(hours=24)
# The role in the name this process holds outbox messages under ("host:notify:pid"): any process of
# the host can tell that the holder is gone and take its messages at once.
ROLE = "notify"
MESSAGE = TypeAdapter(Message)  # a message of its own, as the outbox keeps it (JSON)

log = logging.getLogger("medic.notify")


@dataclass(eq=False, slots=True)
class Outgoing:
    stage: str  # notify: a message of its own; update: a reply in `parent`'s thread
    message: Message | None = None
    text: str = ""
    parent: Outgoing | None = None
    ref: str | None = None  # the thread reference, once a message of its own is posted
    settled: threading.Event = field(default_factory=threading.Event)  # delivered or given up
    started: datetime | None = None
    tries: int = 0
    error: str = ""
    row: int | None = None  # in the outbox; None: the store did not take it, it is in memory only
    said: datetime = field(default_factory=utcnow)
    redelivered: bool = False  # claimed from a process that is gone

    def describe(self) -> str:
        return self.message.title if self.message is not None else self.text

    def stale(self) -> str | None:
        """Why the message must not go out at all, if it must not."""
        if utcnow() - self.said > MAX_AGE:
            return f"pending for more than {MAX_AGE.total_seconds() / 3600:g} h"
        if self.redelivered and self.message is not None and self.message.approval_run is not None:
            # Its buttons resume a run that ended with its process: the incident's pickup asks again.
            return "an approval request whose flow run ended with the process that said it"
        return None


class OutboxRows:
    """One incident's rows in the outbox. Never raises: a store that is down costs the message its
    row (it is sent from memory only), or the row its latest news (the log says it)."""

    def __init__(self, incident_id: str, store: Store) -> None:
        self.incident_id, self.store = incident_id, store
        self._held_at = 0.0  # when this process last renewed its hold (monotonic)

    def keep(self, item: Outgoing) -> int | None:
        try:
            return self.store.queue_message(
                self.incident_id,
                item.stage,
                message=MESSAGE.dump_python(item.message, mode="json") if item.message else None,
                text=item.text,
                parent_id=item.parent.row if item.parent is not None else None,
                owner=runner_name(ROLE),
                lease_s=LEASE_S,
            )
        except Exception:  # the store is down: sent all the same, but lost if this process stops
            run_logger(log).exception(
                "%s: message %r not kept in the outbox; sent from memory only",
                self.incident_id,
                item.describe(),
            )
            return None

    def hold(self) -> None:
        """Renew this process's hold on its outbox messages, once a third of it has passed."""
        if time.monotonic() - self._held_at < LEASE_S / 3:
            return
        try:
            self.store.renew_messages(runner_name(ROLE), LEASE_S)
            self._held_at = time.monotonic()
        except Exception:  # the store is down: the hold may lapse, and another process send them too
            run_logger(log).exception("%s: renewing the hold on the outbox failed", self.incident_id)

    def note_try(self, item: Outgoing) -> None:
        if item.row is None:
            return
        try:
            self.store.note_try(item.row, item.tries, item.error)
        except Exception:  # the store is down: the settled row will say it
            run_logger(log).exception("%s: noting a failed try in the outbox failed", self.incident_id)

    def record(self, item: Outgoing, status: str, why: str = "") -> None:
        """The step that says what became of the message; and its outbox row settled with it."""
        detail: dict[str, object] = {"tries": item.tries}
        if item.redelivered:
            detail["redelivered"] = True
        if status == StepStatus.OK and item.message is not None:
            assert item.message is not None
            summary = f"posted to {item.message.channel} (thread {item.ref})"
            detail["thread"] = item.ref
        elif status == StepStatus.OK:
            summary = item.text
        else:
            summary = f"{item.describe()!r} not delivered: {why}"
        started = item.started or utcnow()
        try:
            if item.row is None:
                self.store.add_step(self.incident_id, item.stage, started, status, summary, detail)
            else:
                step = StepRecord(
                    incident_id=self.incident_id,
                    stage=item.stage,
                    started_at=started,
                    finished_at=utcnow(),
                    status=status,
                    summary=summary,
                    detail=detail,
                )
                settled = MessageStatus.DELIVERED if status == StepStatus.OK else MessageStatus.GIVEN_UP
                self.store.settle_message(
                    item.row, settled, tries=item.tries, error=item.error, ref=item.ref, step=step
                )
        except Exception:  # the store is down too: the log line above is what is left
            run_logger(log).exception("%s: the %s step could not be recorded", self.incident_id, item.stage)
        finally:
            item.settled.set()


def resent(row: OutboxRecord) -> Outgoing:
    message = MESSAGE.validate_python(row.message) if row.message is not None else None
    return Outgoing(
        row.stage,
        message=message,
        text=row.text,
        started=row.created_at,
        tries=row.tries,
        error=row.error,
        row=row.id,
        said=row.created_at,
        redelivered=True,
    )


def posted(row: OutboxRecord | None) -> Outgoing:
    """A reply's message that is settled already: its thread, if it was delivered (a message the
    outbox lacks, because the store did not take it, was not, as far as anyone can tell)."""
    parent = Outgoing("notify", ref=row.ref if row is not None else None)
    parent.settled.set()
    return parent
