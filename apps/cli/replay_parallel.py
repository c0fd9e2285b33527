"""`medic policy replay` over the store, in two processes when the machine has the cores for them.

The incidents split in two halves by when they opened: a forked process reads and decides the later
half again while this one does the earlier, each reading only the cluster's events around its own
decisions; then this one replays the guardrails over both in time order (medic/policy/replay.py).
Where a decision may have read beyond its half's history, the halves are not the one replay they
stand for: the replay is made again whole, in this process. Either way the report is the same.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import replace
from datetime import datetime
from multiprocessing.connection import Connection

from medic.policy import LoadedPolicy
from medic.policy.replay import decided_as_one, redecide, replay
from medic.policy.replay_report import Redecided, Redecisions, ReplayReport, judge
from medic.store import Store

# Below this many incidents a second process (forked, then handing its decisions back) saves a few
# tenths of a second at most: not worth the memory of a second copy.
PARALLEL_FROM = 5_000


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
    try:
        part, rows = receive.recv()
        later: Redecisions | None = replace(part, decisions=list(map(Redecided._make, rows)))
    except EOFError:  # it died: its traceback is on stderr
        later = None
    child.join()
    if later is None or not decided_as_one([mine, later], lookback):
        return replay(store.replay_history(since=since, lookback=lookback), loaded, since)
    return judge([mine, later], loaded, earlier.breaker_closed_at, since)


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
