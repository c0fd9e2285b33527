"""Notify: one message per incident, then its story in the thread as the flow moves.

Chat never holds a node out of service. `IncidentThread.open` and `say` only queue a message;
one worker thread per incident sends the queue in order (a message before the replies in its
thread), trying again with backoff whatever the chat did not take, so the flow goes on to the
next stage at once. The run waits for chat once, at its very end, for at most FLUSH_S
(`flush`); a message still not delivered then, or refused for good before, is recorded as a
failed `notify` / `update` step and logged: never dropped in silence. The approval request
goes through the same queue, behind the incident's own messages, and is waited for (at most
`delivered`'s bound) before the run pauses for an answer.

Every message is also kept in the store's outbox (medic/store/outbox.py) from the moment it is
said until it is settled, held by this process while it tries. A process that stops or dies
meanwhile leaves its messages there, and the next `medic serve` start, or any live replica's
pickup, claims them and sends them again (`redeliver`): at worst a message is posted twice
(decisions/0004), never lost in silence. One pending for longer than MAX_AGE is given up.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import weakref
from collections import defaultdict, deque
from dataclasses import replace

from medic.artifacts import Artifact
from medic.errors import PermanentError
from medic.protocols import Message, Notifier
from medic.statuses import StepStatus
from medic.store import Store, utcnow
from medic.tasks.runtime.outbox_rows import LEASE_S, ROLE, OutboxRows, Outgoing, posted, resent
from medic.tasks.runtime.process import Runtime, current
from medic.tasks.runtime.runners import dead_runners, runner_name
from medic.tasks.runtime.stage import run_logger

# The final flush: the longest a run waits for chat, after everything else it does.
FLUSH_S = 10.0
# Between two tries of one message (seconds); the last pause repeats until the run ends.
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
# Between two tries while the final flush waits.
CLOSING_PAUSE_S = 1.0
# A worker with nothing to send this long ends; the next message starts another.
IDLE_S = 60.0

log = logging.getLogger("medic.notify")


class _Outbox:
    """One incident's messages, sent in order by a worker thread of its own."""

    def __init__(self, incident_id: str, notifier: Notifier, store: Store) -> None:
        self.incident_id, self.notifier, self.store = incident_id, notifier, store
        self.failed = 0
        self._queue: deque[Outgoing] = deque()
        self._sending: Outgoing | None = None  # in a call to the notifier right now
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self.closed = False  # the run's final flush began: nothing more is taken
        self._abandon = False  # the flush ran out of time: stop trying
        self.rows = OutboxRows(incident_id, store)
        # The flow run's context, so a message links its run and the worker logs to it.
        self._context = contextvars.copy_context()
        with _every_lock:
            _every.add(self)

    def put(self, item: Outgoing) -> None:
        """Queue a message, kept in the outbox first unless it is there already (redelivered)."""
        with self._cond:
            if self.closed:  # nobody waits for it any more
                self._queue.append(item)
                self._give_up_queued("said after the run's final flush")
                return
            if item.row is None:  # under the lock: the rows' order is the queue's
                item.row = self.rows.keep(item)
            self._queue.append(item)
            if self._worker is None:
                # A copy each: one context cannot be entered by two threads, and an idle worker
                # may still be leaving it while the next one starts.
                self._worker = threading.Thread(
                    target=self._context.copy().run,
                    args=(self._work,),
                    name=f"notify-{self.incident_id}",
                    daemon=True,
                )
                self._worker.start()
            self._cond.notify_all()

    def unsent(self) -> tuple[int, int]:
        """The messages not settled yet: (kept in the outbox, in memory only). Read without the
        lock, which a worker holds while it writes to the store: a stop must not wait on a store
        that hangs (a copy of the queue is one step under the GIL)."""
        left = [item for item in tuple(self._queue) if not item.settled.is_set()]
        kept = sum(1 for item in left if item.row is not None)
        return kept, len(left) - kept

    def close(self, timeout: float) -> list[str]:
        """Wait up to `timeout` for the queue to empty; give up what is left. Returns what was not
        delivered in time (a message still in a call to the chat is settled by the worker)."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()  # a worker pausing between tries tries again now
            if self._cond.wait_for(lambda: not self._queue, timeout):
                return []
            self._abandon = True
            left = [item.describe() for item in self._queue]
            self._give_up_queued(f"not delivered within the run's final {timeout:g} s flush")
            self._cond.notify_all()
        return left

    def _give_up_queued(self, why: str) -> None:
        """Give up every queued message but the one in a call right now (the worker settles it)."""
        for item in [i for i in self._queue if i is not self._sending]:
            self._queue.remove(item)
            self._settle(item, f"{why}{f'; last error: {item.error}' if item.error else ''}")

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._queue, IDLE_S):
                    self._worker = None
                    return
                item = self._queue[0]
            self._deliver(item)

    def _deliver(self, item: Outgoing) -> None:
        item.started = item.started or utcnow()
        parent = item.parent
        if parent is not None and parent.ref is None:
            self._finish(item, "the message it replies to was not delivered")
            return
        stale = item.stale()
        if stale is not None:
            self._finish(item, stale)
            return
        while True:
            with self._cond:
                if item.settled.is_set():  # given up by the final flush while waiting to try again
                    return
                self._sending = item
            self.rows.hold()
            item.tries += 1
            try:
                if item.message is not None:
                    item.ref = self.notifier.post(item.message)
                else:
                    assert parent is not None and parent.ref is not None
                    self.notifier.reply(parent.ref, item.text)
            except Exception as error:  # any failure: a message sent twice costs nothing (decisions/0004)
                if self._failed_try(item, error):
                    continue
                return
            with self._cond:
                self._sending = None
                self._finish_locked(item, None)
            return

    def _failed_try(self, item: Outgoing, error: Exception) -> bool:
        """After a try that failed: True once it is time to try again, False when the message is
        given up (refused for good, stale, or the run's final flush ended)."""
        item.error = f"{type(error).__name__}: {error}"
        refused, stale = isinstance(error, PermanentError), item.stale()
        if not (refused or stale):
            self.rows.note_try(item)
        with self._cond:
            self._sending = None
            if refused or stale or self._abandon:
                self._finish_locked(item, "refused" if refused else stale or "the run's final flush ended")
                return False
            pause = BACKOFF_S[min(item.tries, len(BACKOFF_S)) - 1]
            if self.closed:  # the run is waiting for this: try often while it does
                pause = min(pause, CLOSING_PAUSE_S)
            run_logger(log).warning(
                "%s: chat did not take %r (%s); try %d in %g s",
                self.incident_id,
                item.describe(),
                item.error,
                item.tries + 1,
                pause,
            )
            was_closed = self.closed

            # Try again early once the run's final flush begins, or gives up.
            def woken(closed_before: bool = was_closed) -> bool:
                return self._abandon or self.closed != closed_before

            self._cond.wait_for(woken, pause)
        return True

    def _finish(self, item: Outgoing, why: str | None) -> None:
        with self._cond:
            self._finish_locked(item, why)

    def _finish_locked(self, item: Outgoing, why: str | None) -> None:
        if item.settled.is_set():  # given up by the final flush meanwhile
            return
        if item in self._queue:
            self._queue.remove(item)
        if why is None:
            self.rows.record(item, StepStatus.OK)
        else:
            self._settle(item, why if not item.error or why.endswith(item.error) else f"{why}: {item.error}")
        self._cond.notify_all()

    def _settle(self, item: Outgoing, why: str) -> None:
        """A message given up: recorded as a failed step and logged."""
        self.failed += 1
        run_logger(log).error("%s: message %r not delivered: %s", self.incident_id, item.describe(), why)
        self.rows.record(item, StepStatus.FAILED, why)


# The outbox of each incident being handled in this process: the incident's thread and its
# approval request share it, so they reach the chat in the order the flow said them.
_outboxes: weakref.WeakValueDictionary[str, _Outbox] = weakref.WeakValueDictionary()
_outboxes_lock = threading.Lock()
# Those and the outboxes of messages redelivered here: what a stop leaves unsent.
_every: weakref.WeakSet[_Outbox] = weakref.WeakSet()
_every_lock = threading.Lock()  # not the one above: an outbox is made while that one is held


def _outbox(incident_id: str) -> _Outbox:
    rt = current()
    with _outboxes_lock:
        box = _outboxes.get(incident_id)
        if box is None or box.closed or box.store is not rt.store or box.notifier is not rt.backends.notifier:
            box = _outboxes[incident_id] = _Outbox(incident_id, rt.backends.notifier, rt.store)
        return box


class IncidentThread:
    """A message and the replies in its thread, queued for the incident's worker. Never raises.

    The head goes out when something first needs the thread, not at the start: on the plain
    path that is after the node action. Nothing here waits for the chat but `delivered` (for
    the approval request) and the final `flush`.
    """

    def __init__(self, incident_id: str, head: Message) -> None:
        self.incident_id, self.head = incident_id, head
        self._outbox = _outbox(incident_id)
        self._head = Outgoing("notify", message=head)
        self.opened = False

    @property
    def ok(self) -> bool:
        """Every message of the incident queued so far was delivered, or is still on its way."""
        return self._outbox.failed == 0

    @property
    def ref(self) -> str | None:
        return self._head.ref

    async def open(self) -> None:
        if not self.opened:
            self.opened = True
            self._outbox.put(self._head)

    async def say(self, text: str) -> None:
        await self.open()
        self._outbox.put(Outgoing("update", text=text, parent=self._head))

    async def attach(self, artifacts: tuple[Artifact, ...]) -> None:
        """List more evidence files: in the message itself while it is not queued yet (where they
        are links), else in a reply."""
        new = tuple(a for a in artifacts if a not in self.head.artifacts)
        if not new:
            return
        self.head = replace(self.head, artifacts=(*self.head.artifacts, *new))
        if not self.opened:
            self._head.message = self.head
            return
        await self.say("Evidence files: " + "; ".join(f"{a.what}: {a.path}" for a in new))

    async def delivered(self, timeout: float) -> bool:
        """Wait up to `timeout` for the head to be delivered; False if it was not (yet)."""
        await self.open()
        await asyncio.to_thread(self._head.settled.wait, timeout)
        return self._head.ref is not None

    async def flush(self, timeout: float | None = None) -> bool:
        """The run's final flush: wait up to `timeout` (FLUSH_S) for every message of the incident,
        then give up what is left (recorded and logged). True when all were delivered."""
        timeout = FLUSH_S if timeout is None else timeout
        left = await asyncio.to_thread(self._outbox.close, timeout)
        if left:
            run_logger(log).error(
                "%s: %d message(s) not delivered by the end of the run: %s",
                self.incident_id,
                len(left),
                "; ".join(repr(m) for m in left),
            )
        return self.ok


def redeliver(rt: Runtime) -> int:
    """Claim the messages that processes now gone left pending in the outbox, and send them from
    here, each incident's in the order they were said (the pickup's, medic/flows/live.py). A reply goes in
    its message's thread, posted by the process gone or here first. Returns how many were claimed."""
    me = runner_name(ROLE)
    others = rt.store.message_owners() - {me}
    if not others:  # the usual case: no write to the store every pickup
        return 0
    claimed = rt.store.claim_messages(me, LEASE_S, dead_runners(others, me))
    if not claimed:
        return 0
    log.warning("sending again %d message(s) left in the outbox by a process that is gone", len(claimed))
    items: dict[int | None, Outgoing] = {}
    settled = {r.id: r for r in rt.store.messages(r.parent_id for r in claimed if r.parent_id is not None)}
    by_incident: defaultdict[str, list[Outgoing]] = defaultdict(list)
    for row in claimed:
        item = items[row.id] = resent(row)
        if row.stage == "update":  # its message is claimed with it, or settled before
            item.parent = items.get(row.parent_id) or posted(settled.get(row.parent_id))
        by_incident[row.incident_id].append(item)
    for incident_id, queued in by_incident.items():
        box = _Outbox(incident_id, rt.backends.notifier, rt.store)
        for item in queued:
            box.put(item)
    return len(claimed)


def left_behind() -> None:
    """At a stop (`medic serve` on SIGTERM or Ctrl-C): say what this process leaves unsent. What is
    in the outbox stays pending there for the next start or another replica to send; a message the
    store did not take is lost, and said so."""
    with _every_lock:
        boxes = list(_every)
    counts = [box.unsent() for box in boxes]
    kept, lost = sum(k for k, _ in counts), sum(m for _, m in counts)
    if kept:
        log.warning("%d message(s) left in the outbox for the next start", kept)
    if lost:
        log.error("%d message(s) not delivered and lost: the store did not take them", lost)
