"""What the rest of the cluster shows: recent events from every node, indexed by kind and time.

One node's incident rarely tells the cause. The same NaN at the same iteration and rank on
several nodes is the application; the same XID again and again on one GPU is the hardware;
timeouts from half the nodes under one switch are the network. Rules reach those facts through
this index: events are kept sorted by time per kind and per (kind, node | job | switch |
iteration and rank), so a windowed count looks only at the events that can match.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from operator import attrgetter
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from medic.events import EventKind, FaultEvent


class Seen(Protocol):
    """What cross-node conditions read of an event in the context (medic/policy/engine.py)."""

    @property
    def id(self) -> str: ...
    @property
    def time(self) -> datetime: ...
    @property
    def kind(self) -> EventKind: ...
    @property
    def node(self) -> str: ...
    @property
    def gpu(self) -> int | None: ...
    @property
    def job(self) -> str | None: ...
    @property
    def switch(self) -> str | None: ...
    @property
    def iteration(self) -> int | None: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def attributes(self) -> Mapping[str, Any]: ...


class Trace(NamedTuple):
    """An event as a stream's context keeps it: what cross-node conditions read, and no more. A
    stream holds a day of the cluster's events for its counts; a whole event (its source, message and
    attributes) costs several times as much (BENCHMARKS.md, section 2a)."""

    id: str
    time: datetime
    kind: EventKind
    node: str
    gpu: int | None
    job: str | None
    switch: str | None
    iteration: int | None
    rank: int | None
    attributes: Mapping[str, Any]  # an XID's code, which conditions match; nothing else


_NOTHING: Mapping[str, Any] = MappingProxyType({})


@cache  # one mapping per XID code (a thousand at most), shared by its traces
def _xid_code(code: int) -> Mapping[str, Any]:
    return MappingProxyType({"code": code})


def trace(event: FaultEvent) -> Trace:
    """The event as a stream's context keeps it."""
    attributes = _xid_code(event.attributes["code"]) if event.kind is EventKind.XID else _NOTHING
    return Trace(
        event.id,
        event.time,
        event.kind,
        event.node,
        event.gpu,
        event.job,
        event.switch,
        event.iteration,
        event.rank,
        attributes,
    )


def index_keys(event: Seen) -> list[tuple[Hashable, ...]]:
    """The index entries an event is in: its kind, and its kind with each scope it has a key for
    (its node, job, switch, and (iteration, rank) `mark`)."""
    # Spelled out, not looped over the scopes: every event of a replay's weeks is indexed.
    kind = event.kind
    keys: list[tuple[Hashable, ...]] = [(kind,), (kind, "node", event.node)]
    if event.job is not None:
        keys.append((kind, "job", event.job))
    if event.switch is not None:
        keys.append((kind, "switch", event.switch))
    if event.iteration is not None and event.rank is not None:
        keys.append((kind, "mark", (event.iteration, event.rank)))
    return keys


def series_key(kind: EventKind, scope: str | None, key: Hashable | None) -> tuple[Hashable, ...]:
    """The index entry of one kind's events: all of them (no scope), or one node's, job's, switch's
    or mark's, as `index_keys` names them."""
    return (kind,) if scope is None else (kind, scope, key)


_TIME = attrgetter("time")


class _Series:
    """Events of one index entry, sorted by time, with their times for bisection."""

    __slots__ = ("events", "times")

    def __init__(self) -> None:
        self.events: list[FaultEvent] = []
        self.times: list[datetime] = []

    def between(self, start: datetime, end: datetime) -> list[FaultEvent]:
        return self.events[bisect_left(self.times, start) : bisect_right(self.times, end)]

    def count(self, start: datetime, end: datetime) -> int:
        return bisect_right(self.times, end) - bisect_left(self.times, start)


@dataclass(frozen=True, slots=True)
class Around:
    """Where one decision's cross-node conditions can look (medic/policy/engine.py, `_lookups` and
    `_switch`): events of `kinds` on the incident's nodes, jobs or switches, or at its iterations
    (a `same_iteration_rank` count's marks); anywhere when a condition counts across the whole
    cluster. A decision reads only these from the store: reading every event of the lookback made
    its cost grow with the fleet and with the burst it is part of (BENCHMARKS.md, "At fleet scale")."""

    kinds: frozenset[EventKind]
    nodes: frozenset[str] = frozenset()
    jobs: frozenset[str] = frozenset()
    switches: frozenset[str] = frozenset()
    iterations: frozenset[int] = frozenset()
    everywhere: bool = False

    def takes(self, event: Seen) -> bool:
        """Whether the store's read (`Store.events_between`) gives `event`: the same test, in Python."""
        if event.kind not in self.kinds:
            return False
        return (
            self.everywhere
            or event.node in self.nodes
            or (event.job is not None and event.job in self.jobs)
            or (event.switch is not None and event.switch in self.switches)
            or (event.iteration is not None and event.iteration in self.iterations)
        )


class Window(Protocol):
    """What cross-node conditions read of the cluster around a decision (medic/policy/engine.py): the
    events of some kinds in a time window, all of them or one node's, job's, switch's or mark's, and
    the sizes percentages are of. `Context` holds them for a batch (the live path, a replay, the
    simulator); a stream keeps only what decisions to come can still reach (medic/triage/recent.py)."""

    @property
    def switch_sizes(self) -> Mapping[str, int]: ...
    @property
    def fleet_size(self) -> int | None: ...

    def window(
        self,
        kinds: Iterable[EventKind],
        start: datetime,
        end: datetime,
        scope: str | None = None,
        key: Hashable | None = None,
    ) -> Iterator[Seen]:
        """Events of these kinds with start <= time <= end, optionally only those of one node,
        job, switch or (iteration, rank) `mark`."""
        ...

    def count(
        self,
        kinds: Iterable[EventKind],
        start: datetime,
        end: datetime,
        scope: str | None = None,
        key: Hashable | None = None,
    ) -> int:
        """How many events `window` would give, without touching them."""
        ...


class Context:
    """A `Window` over a set of events given at once, indexed by kind and scope."""

    def __init__(
        self,
        events: Iterable[FaultEvent] = (),
        *,
        switch_sizes: Mapping[str, int] | None = None,
        fleet_size: int | None = None,
    ) -> None:
        self._series: dict[tuple[Hashable, ...], _Series] = {}
        # One sort of all the events, not one per series: most series hold an event or two, and the
        # events mostly come in time order already (a stable sort keeps equal times in their order).
        for event in sorted(events, key=_TIME):
            for key in index_keys(event):
                series = self._series.get(key)
                if series is None:  # not `setdefault`: it would build a series for every event
                    series = self._series[key] = _Series()
                series.events.append(event)
                series.times.append(event.time)
        self.switch_sizes: Mapping[str, int] = switch_sizes or {}
        self.fleet_size = fleet_size

    def window(
        self,
        kinds: Iterable[EventKind],
        start: datetime,
        end: datetime,
        scope: str | None = None,
        key: Hashable | None = None,
    ) -> Iterator[Seen]:
        """Events of these kinds with start <= time <= end, optionally only those of one node,
        job, switch or (iteration, rank) `mark`."""
        for kind in kinds:
            series = self._series.get(series_key(kind, scope, key))
            if series is not None:
                yield from series.between(start, end)

    def count(
        self,
        kinds: Iterable[EventKind],
        start: datetime,
        end: datetime,
        scope: str | None = None,
        key: Hashable | None = None,
    ) -> int:
        """How many events `window` would give, without touching them."""
        get = self._series.get
        return sum(
            series.count(start, end) for kind in kinds if (series := get(series_key(kind, scope, key)))
        )


EMPTY = Context()
