"""The context of a stream: the cluster's recent events, as cross-node conditions read them, kept only
as long as a decision to come can look back at them. The stream's side of `medic.context.Window`; the
batch side is `medic.context.Context`."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from medic.context import Seen, Trace, index_keys, series_key, trace
from medic.events import EventKind, FaultEvent
from medic.policy import Policy

# Times in the stream are integer microseconds since the epoch: the same order as the aware
# datetimes, without the time-zone arithmetic each datetime comparison costs.
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)
Key = tuple[int, str]  # (time, id): the order of events, and of incidents by their first event


def micros(moment: datetime) -> int:
    return (moment - EPOCH) // MICROSECOND


def lookbacks(policy: Policy) -> dict[EventKind, timedelta]:
    """How far back cross-node conditions look, per kind they count: the context worth keeping."""
    reach: dict[EventKind, timedelta] = {}
    for rule in policy.every_rule():  # a group's rules count too, for its nodes
        spans = [(c.event_kinds(), c.within_minutes) for c in rule.when.count or ()]
        if rule.when.switch:
            spans.append((tuple(rule.when.switch.kinds), rule.when.switch.within_minutes))
        for kinds, minutes in spans:
            for kind in kinds:
                reach[kind] = max(reach.get(kind, timedelta()), timedelta(minutes=minutes))
    return reach


@dataclass(slots=True)
class _Series:
    """The events of one index entry, in time order, with their times (microseconds) to bisect."""

    events: list[Trace] = field(default_factory=list)
    times: list[int] = field(default_factory=list)


class RecentWindow:
    """The context of a stream: events added in time order, dropped once no decision to come can
    look back at them. Only the kinds some condition counts are kept (no other is ever asked for),
    each event as a `Trace` of what those conditions read. Indexed as `Context` indexes (by kind, and
    by kind and node, job, switch or mark)."""

    def __init__(self, lookbacks: dict[EventKind, timedelta], fleet_size: int | None) -> None:
        self.switch_sizes: Mapping[str, int] = {}  # a stream knows no switch's size
        self.fleet_size = fleet_size
        self._lookbacks = lookbacks
        self._index: dict[tuple[Hashable, ...], _Series] = {}
        self._arrivals: dict[EventKind, deque[tuple[int, Trace]]] = {}  # in time order, per kind
        self.entries = 0  # events held, counted once per index entry they are in

    def add(self, event: FaultEvent, at: int) -> None:
        if event.kind not in self._lookbacks:
            return
        kept = trace(event)
        for entry in index_keys(kept):
            series = self._index.get(entry)
            if series is None:
                series = self._index[entry] = _Series()
            series.events.append(kept)
            series.times.append(at)
            self.entries += 1
        self._arrivals.setdefault(event.kind, deque()).append((at, kept))

    def window(
        self,
        kinds: Iterable[EventKind],
        start: datetime,
        end: datetime,
        scope: str | None = None,
        key: Hashable | None = None,
    ) -> Iterator[Seen]:
        low, high = micros(start), micros(end)
        for kind in kinds:
            series = self._index.get(series_key(kind, scope, key))
            if series is not None:
                yield from series.events[bisect_left(series.times, low) : bisect_right(series.times, high)]

    def count(
        self,
        kinds: Iterable[EventKind],
        start: datetime,
        end: datetime,
        scope: str | None = None,
        key: Hashable | None = None,
    ) -> int:
        low, high = micros(start), micros(end)
        found = 0
        for kind in kinds:
            series = self._index.get(series_key(kind, scope, key))
            if series is not None:
                found += bisect_right(series.times, high) - bisect_left(series.times, low)
        return found

    def forget_before(self, moment: int) -> None:
        """Drop what no window ending at `moment` or later reaches: each kind's oldest events
        first, which are the first of every index entry they are in."""
        gone: Counter[tuple[Hashable, ...]] = Counter()
        for kind, arrivals in self._arrivals.items():
            cutoff = moment - self._lookbacks[kind] // MICROSECOND
            while arrivals and arrivals[0][0] < cutoff:
                gone.update(index_keys(arrivals.popleft()[1]))
        for entry, count in gone.items():
            series = self._index[entry]
            if count == len(series.times):
                del self._index[entry]
            else:
                del series.events[:count], series.times[:count]
        self.entries -= gone.total()
