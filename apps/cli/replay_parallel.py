"""`medic policy replay` over the store, in two processes when the machine has the cores for them.

The incidents split in two halves by when they opened: a forked process reads and decides the later
half again while this one does the earlier, each reading only the cluster's events around its own
decisions. This one replays the guardrails in time order (medic/policy/replay_report.py): over its
own decisions made before the later half began while the other still decides, then over the rest.
Where a decision may have read beyond its half's history, the halves are not the one replay they
stand for: the replay is made again whole, in this process. Either way the report is the same.
"""

from __future__ import annotations

import heapq
import multiprocessing
import os
from bisect import bisect_left
from dataclasses import replace
from datetime import datetime
from multiprocessing.connection import Connection
from operator import attrgetter

from medic.policy import LoadedPolicy
from medic.policy.replay import decided_as_one, redecide, replay
from medic.policy.replay_report import Judge, Redecided, Redecisions, ReplayReport, judge
from medic.store import Store

# Below this many incidents a second process (forked, then handing its decisions back) saves a few
# tenths of a second at most: not worth the memory of a second copy.
PARALLEL_FROM = 5_000
_MADE_AT = attrgetter("decided_at")


def replay_store(
    store: Store, loaded: LoadedPolicy, since: datetime | None, *, parallel_from: int = PARALLEL_FROM
) -> ReplayReport:
    """Replay the incidents opened since `since` (all when None) with `loaded`."""
    lookback = loaded.policy.lookback()
    split = store.replay_split(since) if _cores() >= 2 and _can_fork() else None
    if split is None or split.incidents < parallel_from:
        return replay(store.replay_history(since=since, lookback=lookback), loaded, since)
    forks = multiprocessing.get_context("fork")
    receive, send = forks.Pipe(duplex=False)
    # The later half's windows reach back `lookback` from its incidents' evidence, which comes when they
    # open: it reads from a further `lookback` earlier, for evidence that came late.
    later_start = split.middle - 2 * lookback
    child = forks.Process(
        target=_decide_later, args=(store, loaded, split.middle, later_start, send), daemon=True
    )
    child.start()
    send.close()
    earlier = store.replay_history(since=since, until=split.middle, lookback=lookback)
    mine = redecide(earlier, loaded)
    # The guardrails replayed over this half's decisions made before the later half's incidents
    # opened, while the other process still decides: those come before every decision of its half.
    judging = Judge(loaded, earlier.breaker_closed_at)
    ahead = bisect_left(mine.decisions, split.middle, key=_MADE_AT)
    judging.take(mine.decisions[:ahead])
    try:
        part, rows = receive.recv()
        later: Redecisions | None = replace(part, decisions=list(map(Redecided._make, rows)))
    except EOFError:  # it died: its traceback is on stderr
        later = None
    child.join()
    if later is None or not decided_as_one([mine, later], lookback):
        return replay(store.replay_history(since=since, lookback=lookback), loaded, since)
    if later.decisions and later.decisions[0].decided_at < split.middle:
        # A decision recorded before its incident opened (a replica's clock behind): judged again, all
        # in order.
        return judge([mine, later], loaded, earlier.breaker_closed_at, since)
    judging.take(heapq.merge(mine.decisions[ahead:], later.decisions))
    return judging.report([mine, later], since)


def _decide_later(
    store: Store, loaded: LoadedPolicy, middle: datetime, start: datetime, send: Connection
) -> None:
    """The forked process: the later half's history, decided again, handed back."""
    store.engine.dispose(close=False)  # the parent's connections stay the parent's
    history = store.replay_history(since=middle, lookback=loaded.policy.lookback(), start=start)
    decided = redecide(history, loaded)
    # The decisions as plain tuples: pickled, named ones cost twice as much, on the way to the report.
    send.send((replace(decided, decisions=()), [tuple(d) for d in decided.decisions]))
    send.close()


def _cores() -> int:
    """The cores this process may run on (what `nproc` prints)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _can_fork() -> bool:
    # The later half's process starts as a copy of this one: with the policy loaded and the store open,
    # not with a fresh interpreter importing everything again.
    return "fork" in multiprocessing.get_all_start_methods()
