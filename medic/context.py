"""What the rest of the cluster shows: recent events from every node, indexed by kind and time.

One node's incident rarely tells the cause. The same NaN at the same iteration and rank on
several nodes is the application; the same XID again and again on one GPU is the hardware;
timeouts from half the nodes under one switch are the network. Rules reach those facts through
this index, which windowed counts query in O(log n + k).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime

from medic.events import EventKind, FaultEvent


class Context:
    def __init__(
        self,
        events: Iterable[FaultEvent] = (),
        *,
        switch_sizes: Mapping[str, int] | None = None,
        fleet_size: int | None = None,
    ) -> None:
        by_kind: dict[EventKind, list[FaultEvent]] = {}
        for event in events:
            by_kind.setdefault(event.kind, []).append(event)
        self._events = {kind: sorted(found, key=lambda e: e.time) for kind, found in by_kind.items()}
        self._times = {kind: [e.time for e in found] for kind, found in self._events.items()}
        self.switch_sizes: Mapping[str, int] = switch_sizes or {}
        self.fleet_size = fleet_size

    def count(self, kinds: Iterable[EventKind], start: datetime, end: datetime) -> int:
        """How many events of these kinds lie in the range, without touching them."""
        total = 0
        for kind in kinds:
            times = self._times.get(kind)
            if times:
                total += bisect_right(times, end) - bisect_left(times, start)
        return total

    def window(self, kinds: Iterable[EventKind], start: datetime, end: datetime) -> Iterator[FaultEvent]:
        """Events of these kinds with start <= time <= end."""
        for kind in kinds:
            times = self._times.get(kind)
            if times:
                found = self._events[kind]
                yield from found[bisect_left(times, start) : bisect_right(times, end)]


EMPTY = Context()
