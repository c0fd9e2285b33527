"""Containment first on the warm path (docs/decisions/0011-containment-first.md).

A burst's drains are the seconds that count, and every flow run started beside them takes CPU from
them (BENCHMARKS.md, "At fleet scale"). New flow runs wait while any containment is pending; the
containments go a few at a time, so the first ones finish first instead of all finishing late
together, and those whose own events already say "take the node out" go before those that will most
likely leave it."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import anyio

from medic.facts import facts_of
from medic.incidents import Incident
from medic.policy import decide
from medic.tasks.nodes.contain import CONTAINED, contain
from medic.tasks.nodes.guard import ensure_limits
from medic.tasks.runtime.process import Runtime

log = logging.getLogger("medic.live")
CONTAIN_CONCURRENCY = 4
CONTAIN_FIRST_MAX_S = 60.0


class Containment:
    """The containments of one process, a few at a time, the most urgent first."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._pending = 0
        self._none_pending = asyncio.Event()
        self._none_pending.set()
        self._turns = Turns(CONTAIN_CONCURRENCY)

    async def contain(self, incident: Incident) -> None:
        """Drain the node first where the decision takes it out (medic/tasks/nodes/contain.py); then
        wait, at most CONTAIN_FIRST_MAX_S, until no containment is pending. One that fails leaves the
        work to the incident's run, which drains as it always has."""
        self._pending += 1
        self._none_pending.clear()
        try:
            await ensure_limits()  # made by the warm-up, unless the API was not there yet
            async with self._turns.turn(self.urgency(incident)):
                await anyio.to_thread.run_sync(contain, self.rt, incident.id, incident.node, incident.scope)
        except Exception:
            log.exception("containment of %s on %s failed; its flow run goes on", incident.id, incident.node)
        finally:
            self._pending -= 1
            if not self._pending:
                self._none_pending.set()
        with anyio.move_on_after(CONTAIN_FIRST_MAX_S):  # a burst that never ends must not stall the runs
            await self._none_pending.wait()

    def urgency(self, incident: Incident) -> int:
        """0 for an incident whose first answer, from its own events alone, takes the node out; 1
        for the rest. Only the order of the containments: each is decided in full all the same."""
        try:
            guess = decide(self.rt.policy().policy, facts_of(incident, now=datetime.now(UTC)))
        except Exception:  # cannot tell: urgent
            return 0
        return 0 if guess.action in CONTAINED else 1


class Turns:
    """At most `size` at a time; those waiting go in by priority (lower first), then by arrival."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @contextlib.asynccontextmanager
    async def turn(self, priority: int) -> AsyncIterator[None]:
        if self._free and not self._waiting:
            self._free -= 1
        else:
            called: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (priority, next(self._arrivals), called))
            try:
                await called
            except asyncio.CancelledError:
                if called.done() and not called.cancelled():
                    self._next()  # given a turn as it was cancelled: pass it on
                raise
        try:
            yield
        finally:
            self._next()

    def _next(self) -> None:
        while self._waiting:
            _, _, called = heapq.heappop(self._waiting)
            if not called.done():
                called.set_result(None)
                return
        self._free += 1
