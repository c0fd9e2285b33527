"""Notify: one message per incident, then its story in the thread as the flow moves.

Chat never holds a node out of service. `IncidentThread.open` and `say` only queue a message;
one worker thread per incident sends the queue in order (a message before the replies in its
thread), trying again with backoff whatever the chat did not take, so the flow goes on to the
next stage at once. The run waits for chat once, at its very end, for at most FLUSH_S
(`flush`); a message still not delivered then, or refused for good before, is recorded as a
failed `notify` / `update` step and logged: never dropped in silence. The approval request
goes through the same queue, behind the incident's own messages, and is waited for (at most
`delivered`'s bound) before the run pauses for an answer.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import datetime

from medic.artifacts import Artifact
from medic.errors import PermanentError
from medic.protocols import Message, Notifier
from medic.statuses import StepStatus
from medic.store import Store, utcnow
from medic.tasks.runtime import current
from medic.tasks.stage import run_logger

# The final flush: the longest a run waits for chat, after everything else it does.
FLUSH_S = 10.0
# Between two tries of one message (seconds); the last pause repeats until the run ends.
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
# Between two tries while the final flush waits.
CLOSING_PAUSE_S = 1.0
# A worker with nothing to send this long ends; the next message starts another.
IDLE_S = 60.0

log = logging.getLogger("medic.notify")


@dataclass(eq=False, slots=True)
class _Outgoing:
    stage: str  # notify: a message of its own; update: a reply in `parent`'s thread
    message: Message | None = None
    text: str = ""
    parent: _Outgoing | None = None
    ref: str | None = None  # the thread reference, once a message of its own is posted
    settled: threading.Event = field(default_factory=threading.Event)  # delivered or given up
    started: datetime | None = None
    tries: int = 0
    error: str = ""

    def describe(self) -> str:
        return self.message.title if self.message is not None else self.text


class _Outbox:
    """One incident's messages, sent in order by a worker thread of its own."""

    def __init__(self, incident_id: str, notifier: Notifier, store: Store) -> None:
        self.incident_id, self.notifier, self.store = incident_id, notifier, store
        self.failed = 0
        self._queue: deque[_Outgoing] = deque()
        self._sending: _Outgoing | None = None  # in a call to the notifier right now
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self.closed = False  # the run's final flush began: nothing more is taken
        self._abandon = False  # the flush ran out of time: stop trying
        # The flow run's context, so a message links its run and the worker logs to it.
        self._context = contextvars.copy_context()

    def put(self, item: _Outgoing) -> None:
        with self._cond:
            if self.closed:  # nobody waits for it any more
                self._queue.append(item)
                self._give_up_queued("said after the run's final flush")
                return
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

    def _deliver(self, item: _Outgoing) -> None:
        item.started = item.started or utcnow()
        parent = item.parent
        if parent is not None and parent.ref is None:
            self._finish(item, "the message it replies to was not delivered")
            return
        while True:
            with self._cond:
                if item.settled.is_set():  # given up by the final flush while waiting to try again
                    return
                self._sending = item
            item.tries += 1
            try:
                if item.message is not None:
                    item.ref = self.notifier.post(item.message)
                else:
                    assert parent is not None and parent.ref is not None
                    self.notifier.reply(parent.ref, item.text)
            except Exception as error:  # any failure: a message sent twice costs nothing (decisions/0004)
                item.error = f"{type(error).__name__}: {error}"
                refused = isinstance(error, PermanentError)
                with self._cond:
                    self._sending = None
                    if refused or self._abandon:
                        self._finish_locked(item, "refused" if refused else "the run's final flush ended")
                        return
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
                continue
            with self._cond:
                self._sending = None
                self._finish_locked(item, None)
            return

    def _finish(self, item: _Outgoing, why: str | None) -> None:
        with self._cond:
            self._finish_locked(item, why)

    def _finish_locked(self, item: _Outgoing, why: str | None) -> None:
        if item.settled.is_set():  # given up by the final flush meanwhile
            return
        if item in self._queue:
            self._queue.remove(item)
        if why is None:
            self._record(item, StepStatus.OK)
        else:
            self._settle(item, why if not item.error or why.endswith(item.error) else f"{why}: {item.error}")
        self._cond.notify_all()

    def _settle(self, item: _Outgoing, why: str) -> None:
        """A message given up: recorded as a failed step and logged."""
        self.failed += 1
        run_logger(log).error("%s: message %r not delivered: %s", self.incident_id, item.describe(), why)
        self._record(item, StepStatus.FAILED, why)

    def _record(self, item: _Outgoing, status: str, why: str = "") -> None:
        detail: dict[str, object] = {"tries": item.tries}
        if status == StepStatus.OK and item.message is not None:
            assert item.message is not None
            summary = f"posted to {item.message.channel} (thread {item.ref})"
            detail["thread"] = item.ref
        elif status == StepStatus.OK:
            summary = item.text
        else:
            summary = f"{item.describe()!r} not delivered: {why}"
        try:
            self.store.add_step(
                self.incident_id, item.stage, item.started or utcnow(), status, summary, detail
            )
        except Exception:  # the store is down too: the log line above is what is left
            run_logger(log).exception("%s: the %s step could not be recorded", self.incident_id, item.stage)
        finally:
            item.settled.set()


# The outbox of each incident being handled in this process: the incident's thread and its
# approval request share it, so they reach the chat in the order the flow said them.
_outboxes: weakref.WeakValueDictionary[str, _Outbox] = weakref.WeakValueDictionary()
_outboxes_lock = threading.Lock()


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
        self._head = _Outgoing("notify", message=head)
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
        self._outbox.put(_Outgoing("update", text=text, parent=self._head))

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
