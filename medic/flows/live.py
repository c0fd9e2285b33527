"""The warm path: events `medic serve` has stored become incidents and flow runs in this process.

A new event joins its node's incident while that incident is still being handled, by this
process or another replica (the store keeps one active incident per node), so the running flow
sees the new evidence at its next decision instead of a second flow run starting. A switch-wide
storm's events join its switch's incident even once it was handled, while the storm goes on
within the policy's window. Everything else is correlated into new incidents, each remediated by
its own flow run on a worker thread (flows run sync tasks; the service's event loop must stay
free to acknowledge events).

Each run holds its incident's lease (medic/flows/leases.py). Every `pickup_every` seconds, and at
start, the service claims the incidents still being handled that no live run holds (a replica
or a predecessor killed mid-run) and runs them again from their last recorded step, after
settling the node actions a crash left without an outcome (medic/tasks/nodes/reconcile.py). It also sends
again the chat messages such a process left in the store's outbox (medic/tasks/notify.py).

Before any of that, events pass the job's signals (medic/flows/job_signals.py: stragglers, a hang's
culprit, profile pairs); incidents are opened by medic/flows/opening.py and contained first by
medic/flows/containment.py.

Events a policy `switch` condition counts (collective timeouts, say) are held for
`defaults.storm_hold_seconds` first: the first node to report a switch failure reports it
alone, and deciding on it before its neighbours do would take a healthy node out. Held events
are already stored, so a restart hands them on again from the backlog.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any, Self

import anyio

from medic.events import EventKind, FaultEvent
from medic.flows.containment import Containment
from medic.flows.dispatch import remediate_one, stored
from medic.flows.job_signals import JobSignals
from medic.flows.leases import Leases, runner_name
from medic.flows.opening import IncidentOpener
from medic.incidents import Incident
from medic.pair_profiles import PairTraces
from medic.tasks.nodes.guard import ensure_limits
from medic.tasks.nodes.reconcile import reconcile_intents
from medic.tasks.notify import redeliver
from medic.tasks.runtime.process import Runtime

log = logging.getLogger("medic.live")


class LiveDispatcher:
    """Events in, flow runs out: what is held and when it is handed on, and the runs this process
    started. What happens to the events on the way is the job signals', the opener's and the
    containment's."""

    def __init__(self, rt: Runtime, leases: Leases | None = None, max_concurrent: int = 8) -> None:
        self.rt = rt
        self.leases = leases if leases is not None else Leases(rt.store, runner_name("live"))
        self.signals = JobSignals(rt)
        self.opener = IncidentOpener(rt, self.leases)
        self.containment = Containment(rt)
        self._limiter = anyio.CapacityLimiter(max_concurrent)
        self._tasks: set[asyncio.Task[None]] = set()
        self._held: dict[str, list[FaultEvent]] = {}
        self._correlating = asyncio.Lock()
        self._warming: threading.Thread | None = None
        self._settling = False

    async def warm_up(self) -> None:
        """Start Prefect's API (embedded or remote) before the first fault needs it."""
        await ensure_limits()

    def warm_up_in_background(self) -> None:
        """Warm up on a thread of its own (the embedded API takes seconds to start); flow runs
        wait for it, since one started before the API answers fails to reach it."""
        self._warming = threading.Thread(target=lambda: asyncio.run(self.warm_up()), daemon=True)
        self._warming.start()

    async def __call__(self, events: list[FaultEvent]) -> None:
        # What people did to a node is stored evidence only: no incident, no run (docs/decisions/0019).
        events = [e for e in events if e.kind is not EventKind.NODE_STATE]
        if not events:
            return
        found, pairs = await anyio.to_thread.run_sync(self.signals.sift, events)
        for traces in pairs:
            self._spawn(functools.partial(self._diffed, traces))
        await self._take(found)
        self._settle_later()

    async def _diffed(self, traces: PairTraces) -> None:
        """Diff a pair on a worker thread; the stragglers that waited for its verdict go on at once."""
        await self._take(await anyio.to_thread.run_sync(self.signals.diff, traces))
        self._settle_later()

    async def _take(self, events: list[FaultEvent]) -> None:
        policy = self.rt.policy().policy
        counted = policy.storms().counts
        now = [e for e in events if not counted(e)]
        if now:
            await self._open(now)
        for event in events:
            if counted(event):
                self._hold(event, policy.defaults.storm_hold_seconds)

    async def start(self, incident: Incident) -> None:
        """Remediate one incident whose lease this process holds: here, a flow run in this process."""
        if self._warming is not None:
            await anyio.to_thread.run_sync(self._warming.join)
        try:
            await anyio.to_thread.run_sync(_run_flow, self.rt, incident, limiter=self._limiter)
        except Exception:  # one incident's failure must not stop the service
            log.exception("remediation of %s failed", incident.id)
        finally:
            self.leases.release(incident.id)

    async def pickup(self) -> int:
        """Run every incident still being handled that no live run holds; returns how many.

        Its node actions that a crash left without an outcome are settled first, from the
        provider's record (medic/tasks/nodes/reconcile.py), so the run knows what was done. Chat messages a
        process that is gone left unsent go out again before anything a run picked up now says."""
        await anyio.to_thread.run_sync(redeliver, self.rt)
        claimed = [stored(record) for record in await anyio.to_thread.run_sync(self.leases.pickup)]
        if claimed:
            ids = {incident.id for incident in claimed}
            for line in await anyio.to_thread.run_sync(reconcile_intents, self.rt, ids):
                log.info("reconciled %s", line)
        for incident in claimed:
            log.warning("picking up incident %s on %s: no live run held it", incident.id, incident.node)
            self._spawn(functools.partial(self.start, incident))
        return len(claimed)

    async def pickup_forever(self, every_s: float) -> None:
        while True:
            try:
                await self.pickup()
            except Exception:  # the store or a provider is down: try again next time
                log.exception("picking up orphaned incidents failed")
            await asyncio.sleep(every_s)

    async def drain(self) -> None:
        """Wait for held events and the flow runs started so far (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        """Stop renewing this process's leases (at shutdown): what is still held lapses for a
        replica's pickup instead of being renewed by a process that no longer runs it."""
        self.leases.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _spawn(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        task = asyncio.create_task(work())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _settle_later(self) -> None:
        """Hand on held collective timeouts once they settle: one timer at a time."""
        due = self.signals.next_due()
        if due is None or self._settling:
            return
        self._settling = True

        async def release() -> None:
            await asyncio.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds()))
            self._settling = False
            await self._take(await anyio.to_thread.run_sync(self.signals.settled))
            self._settle_later()

        self._spawn(release)

    def _hold(self, event: FaultEvent, seconds: float) -> None:
        switch = event.switch or ""
        held = self._held.setdefault(switch, [])
        if not held:

            async def release() -> None:
                await asyncio.sleep(seconds)
                mine = self._held.pop(switch)
                await self._open(
                    mine + await anyio.to_thread.run_sync(self.opener.held_elsewhere, switch, mine)
                )

            self._spawn(release)
        held.append(event)

    async def _open(self, events: list[FaultEvent]) -> None:
        async with self._correlating:  # a release and a new batch must not both open an incident
            # Abandoned, not awaited, when the service stops: the events are stored already and the
            # next start takes them up again, while waiting here (on a Prefect API that is starting
            # or gone) would hold the shutdown past its 10 s.
            incidents = await anyio.to_thread.run_sync(self.opener.incidents, events, abandon_on_cancel=True)
            # One at a time, those that take their node out first, each contained as soon as it is
            # opened: a batch of many requests' events must not hold its first drain until every
            # incident in it is open.
            for incident in sorted(incidents, key=self.containment.urgency):
                mine = await anyio.to_thread.run_sync(self.opener.open_one, incident, abandon_on_cancel=True)
                if mine is not None:
                    self._spawn(functools.partial(self._contain_then_start, mine))

    async def _contain_then_start(self, incident: Incident) -> None:
        """Contain first (medic/flows/containment.py), then start the incident's run."""
        if self._warming is not None:
            await anyio.to_thread.run_sync(self._warming.join)  # the guardrail slot lives on the API
        await self.containment.contain(incident)
        await self.start(incident)


def _run_flow(rt: Runtime, incident: Incident) -> None:
    asyncio.run(remediate_one(rt, incident))
