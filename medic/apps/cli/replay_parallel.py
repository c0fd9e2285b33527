"""`medic policy replay` over the store, in two processes when the machine has the cores for them.

The incidents split in two by when they opened: a forked process reads and decides the later part
again while this one does the earlier (a little under half: EARLIER_SHARE), each reading only the
cluster's events around its own decisions. This one replays the guardrails in time order
(medic/whatif/replay_report.py): over its own decisions made before the later part began while the
other still decides, then over the rest. Where a decision may have read beyond its part's history,
the parts are not the one replay they stand for: the replay is made again whole, in this process.
Either way the report is the same."""

from __future__ import annotations

import heapq
import itertools
import multiprocessing
import queue
import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from multiprocessing.connection import Connection
from operator import attrgetter

from medic.apps.cli.forks import can_fork, cores, detach, hand_over
from medic.policy import LoadedPolicy
from medic.store import Store
from medic.whatif.replay import Redeciding, decided_as_one, redecide, replay
from medic.whatif.replay_report import Judge, Redecided, Redecisions, ReplayReport, judge

# Below this many incidents a second process (forked, then handing its decisions back) saves a few
# tenths of a second at most: not worth the memory of a second copy.
PARALLEL_FROM = 5_000
# This process judges every decision, the other's as they come while that one still decides; the other
# reads a `lookback` further back and pickles what it hands over. Timed on 100,000 incidents, both end
# together when this one takes 45-48% of the incidents (BENCHMARKS.md), from run to run.
EARLIER_SHARE = 0.46
_MADE_AT = attrgetter("decided_at")


def replay_store(
    store: Store, loaded: LoadedPolicy, since: datetime | None, *, parallel_from: int = PARALLEL_FROM
) -> ReplayReport:
    """Replay the incidents opened since `since` (all when None) with `loaded`."""
    lookback = loaded.policy.lookback()
    split = store.replay_split(since, EARLIER_SHARE) if cores() >= 2 and can_fork() else None
    if split is None or split.incidents < parallel_from:
        return replay(store.replay_history(since=since, lookback=lookback), loaded, since)
    forks = multiprocessing.get_context("fork")
    receive, send = forks.Pipe(duplex=False)
    # The later part's windows reach back `lookback` from its incidents' evidence, which comes when they
    # open: it reads from a further `lookback` earlier, for evidence that came late.
    later_start = split.middle - 2 * lookback
    child = forks.Process(
        target=_decide_later, args=(store, loaded, split.middle, later_start, receive, send), daemon=True
    )
    child.start()
    send.close()
    earlier = store.replay_history(since=since, until=split.middle, lookback=lookback)
    mine = redecide(earlier, loaded)
    # The guardrails replayed over this part's decisions made before the later part's incidents
    # opened, while the other process still decides: those come before every decision of its part.
    judging = Judge(loaded, earlier.breaker_closed_at)
    ahead = bisect_left(mine.decisions, split.middle, key=_MADE_AT)
    judging.take(mine.decisions[:ahead])
    handed = _Handed(receive)
    coming = iter(handed)
    first = next(coming, None)
    # A decision recorded before its incident opened (a replica's clock behind) cannot be merged in
    # order: then all are judged again once every one is here. Otherwise the later part's decisions are
    # judged as they come, while the other process still decides.
    behind = first is not None and first.decided_at < split.middle
    if behind:
        deque(coming, maxlen=0)
    else:
        arriving = coming if first is None else itertools.chain((first,), coming)
        judging.take(heapq.merge(mine.decisions[ahead:], arriving))
    later = handed.part()
    if later is None or not decided_as_one([mine, later], lookback):  # what was judged is thrown away
        child.join()
        return replay(store.replay_history(since=since, lookback=lookback), loaded, since)
    parts = [mine, later]
    report = (
        judge(parts, loaded, earlier.breaker_closed_at, since) if behind else judging.report(parts, since)
    )
    child.join()  # only now: it has sent everything, and freeing what it holds takes it tenths of a second
    return report


# Decisions handed over at a time: a few hundred kilobytes pickled, so that this process judges them
# while the other still decides the rest, and waits for at most one handful at the end.
HANDFUL = 2_000


def _decide_later(
    store: Store,
    loaded: LoadedPolicy,
    middle: datetime,
    start: datetime,
    receive: Connection,
    send: Connection,
) -> None:
    """The forked process: the later part's history decided again, handed back as they are made, then
    what they read."""
    detach(receive)
    store.engine.dispose(close=False)  # the parent's connections stay the parent's
    history = store.replay_history(since=middle, lookback=loaded.policy.lookback(), start=start)
    deciding = Redeciding(history, loaded)
    # Sent by a thread: the pipe holds one handful at most, and this process goes on deciding while
    # the other, still deciding its own part, has not begun to read.
    outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    # A daemon: should deciding fail, the process ends and the other reads the end of the pipe.
    sender = threading.Thread(target=hand_over, args=(outbox.get, send.send, send), daemon=True)
    sender.start()
    handful: list[tuple[object, ...]] = []
    for decided in deciding:
        handful.append(tuple(decided))  # plain tuples: pickled, named ones cost twice as much
        if len(handful) == HANDFUL:
            outbox.put(handful)
            handful = []
    if handful:
        outbox.put(handful)
    outbox.put(deciding.summary(()))
    outbox.put(None)
    sender.join()


class _Handed:
    """The decisions the forked process hands over, in the order it made them, then its summary."""

    def __init__(self, receive: Connection) -> None:
        self.receive = receive
        self.received: list[Redecided] = []
        self.summary: Redecisions | None = None

    def __iter__(self) -> Iterator[Redecided]:
        while True:
            try:
                message = self.receive.recv()
            except EOFError:  # it died: its traceback is on stderr
                return
            if isinstance(message, Redecisions):
                self.summary = message
                return
            handful = list(map(Redecided._make, message))
            self.received.extend(handful)
            yield from handful

    def part(self) -> Redecisions | None:
        """Every decision received with the summary; None when the process died first."""
        return None if self.summary is None else replace(self.summary, decisions=self.received)
