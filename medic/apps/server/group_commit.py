"""Group commit: the events of requests that arrive together are stored in one transaction.

Every audited commit appends to the one audit chain under one lock, held until the commit is on
disk (medic/store/ledger.py). One transaction per request makes a replica's intake as fast as
one commit after another: about 120 one-event requests a second on PostgreSQL here, however many
connections (BENCHMARKS.md, "At fleet scale", item 4). So the requests waiting while one commit
runs are committed together by the next: each request is still answered only once its own events
are durable, and a quiet replica still commits each request on its own, at once.

A batch that fails is committed again request by request, so that one request's trouble is its
own answer and not its neighbours'; a store that is down fails each of them alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from medic.events import FaultEvent

Record = Callable[[list[FaultEvent]], list[FaultEvent]]  # stores events; returns those that were new


@dataclass(eq=False)
class _Request:
    events: Sequence[FaultEvent]
    stored: list[FaultEvent] | None = None  # None: not committed
    error: BaseException | None = None
    done: bool = False


class GroupCommit:
    """`record(events)`: store them with whatever other requests are waiting, and return the ones
    this request brought that were new. Blocking: called from the request's worker thread."""

    def __init__(self, record: Record) -> None:
        self._record = record
        self._changed = threading.Condition()
        self._waiting: list[_Request] = []
        self._committing = False
        self.commits = 0  # transactions made (tests, and the benchmark's figures)

    def record(self, events: Sequence[FaultEvent]) -> list[FaultEvent]:
        mine = _Request(events)
        with self._changed:
            self._waiting.append(mine)
            while self._committing and not mine.done:
                self._changed.wait()
            if not mine.done:  # nobody is committing: this thread commits all that waits
                batch, self._waiting, self._committing = self._waiting, [], True
        if not mine.done:
            try:
                self._commit(batch)
            finally:
                with self._changed:
                    self._committing = False
                    self._changed.notify_all()
        if mine.error is not None:
            raise mine.error
        assert mine.stored is not None  # _commit gives every request of its batch one or the other
        return mine.stored

    def _commit(self, batch: list[_Request]) -> None:
        try:
            self._store_together(batch)
        except Exception as error:
            if len(batch) == 1:
                batch[0].error = error
            else:
                for request in batch:
                    try:
                        self._store_together([request])
                    except Exception as own:
                        request.error = own
        finally:
            for request in batch:  # whatever stopped the commit, nothing unstored is acknowledged
                if request.stored is None and request.error is None:
                    request.error = RuntimeError("the events were not committed")
                request.done = True

    def _store_together(self, batch: list[_Request]) -> None:
        self.commits += 1
        new = {e.id: e for e in self._record([e for r in batch for e in r.events])}
        for request in batch:  # a new event is the first request's that brought it: later ones' duplicate
            request.stored = [new.pop(e.id) for e in request.events if e.id in new]
