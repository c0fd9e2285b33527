"""The warm path: events `medic serve` has stored become incidents and flow runs in this process.

A new event joins its node's incident while that incident is still being handled (its
switch's, for a switch-wide storm, even once handled) and the event falls within the
policy's window, so the running flow sees the new evidence at its next decision instead of
a second flow run starting. Everything else is correlated into new incidents, each
remediated by its own flow run on a worker thread (flows run sync tasks; the service's
event loop must stay free to acknowledge events).

Events a policy `switch` condition counts (collective timeouts, say) are held for
`defaults.storm_hold_seconds` first: the first node to report a switch failure reports it
alone, and deciding on it before its neighbours do would take a healthy node out. Held events
are already stored, so a restart hands them on again from the backlog.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Coroutine
from datetime import datetime, timedelta
from typing import Any

import anyio

from flows.dispatch import remediate_one
from medic.events import FaultEvent
from medic.incidents import Incident, Scope, Storms, correlate
from medic.statuses import ACTIVE_INCIDENT_STATUSES, TERMINAL_INCIDENT_STATUSES
from medic.store.tables import IncidentRecord
from tasks import prefect_events
from tasks.evidence import storms
from tasks.guard import ensure_limits
from tasks.runtime import Runtime

log = logging.getLogger("medic.live")


class LiveDispatcher:
    def __init__(self, rt: Runtime, max_concurrent: int = 8) -> None:
        self.rt = rt
        self._limiter = anyio.CapacityLimiter(max_concurrent)
        self._tasks: set[asyncio.Task[None]] = set()
        self._held: dict[str, list[FaultEvent]] = {}
        self._correlating = asyncio.Lock()
        self._warming: threading.Thread | None = None

    async def warm_up(self) -> None:
        """Start Prefect's API (embedded or remote) before the first fault needs it."""
        await ensure_limits()

    def warm_up_in_background(self) -> None:
        """Warm up on a thread of its own (the embedded API takes seconds to start); flow runs
        wait for it, since one started before the API answers fails to reach it."""
        self._warming = threading.Thread(target=lambda: asyncio.run(self.warm_up()), daemon=True)
        self._warming.start()

    async def __call__(self, events: list[FaultEvent]) -> None:
        policy = self.rt.policy().policy
        counted = policy.storms().counts
        now = [e for e in events if not counted(e)]
        if now:
            await self._open(now)
        for event in events:
            if counted(event):
                self._hold(event, policy.defaults.storm_hold_seconds)

    async def start(self, incident: Incident) -> None:
        """Remediate one new incident: here, a flow run in this process."""
        if self._warming is not None:
            await anyio.to_thread.run_sync(self._warming.join)
        try:
            await anyio.to_thread.run_sync(_run_flow, self.rt, incident, limiter=self._limiter)
        except Exception:  # one incident's failure must not stop the service
            log.exception("remediation of %s failed", incident.id)

    async def drain(self) -> None:
        """Wait for held events and the flow runs started so far (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _spawn(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        task = asyncio.create_task(work())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _hold(self, event: FaultEvent, seconds: float) -> None:
        switch = event.switch or ""
        held = self._held.setdefault(switch, [])
        if not held:

            async def release() -> None:
                await asyncio.sleep(seconds)
                await self._open(self._held.pop(switch))

            self._spawn(release)
        held.append(event)

    async def _open(self, events: list[FaultEvent]) -> None:
        async with self._correlating:  # a release and a new batch must not both open an incident
            incidents = await anyio.to_thread.run_sync(self._correlate, events)
        for incident in incidents:
            self._spawn(lambda incident=incident: self.start(incident))

    def _correlate(self, events: list[FaultEvent]) -> list[Incident]:
        policy = self.rt.policy().policy
        window = timedelta(minutes=policy.defaults.incident_window_minutes)
        current = policy.storms()
        if any(current.counts(e) for e in events):
            current = storms(self.rt)  # the scheduler's switch sizes, asked only when they matter
        fresh = self._join_active(events, window, current)
        incidents = correlate(fresh, window, current)
        self.rt.store.attach_events(incidents)
        for incident in incidents:
            self.rt.store.open_incident(incident)
            prefect_events.incident_opened(incident)
        return incidents

    def _join_active(self, events: list[FaultEvent], window: timedelta, current: Storms) -> list[FaultEvent]:
        """Attach events to the incidents being handled that they belong to; return the rest."""
        switches = {e.switch for e in events if current.counts(e)}
        storming = {s for s in switches if s and self._active(s, "switch") is not None}
        by_subject: dict[tuple[Scope, str], list[FaultEvent]] = defaultdict(list)
        for event in sorted(events, key=lambda e: (e.time, e.id)):
            switch_wide = current.counts(event) and event.switch in storming
            by_subject[("switch", event.switch or "") if switch_wide else ("node", event.node)].append(event)
        fresh: list[FaultEvent] = []
        for (scope, subject), found in by_subject.items():
            active = self._active(subject, scope)
            joined = _within(found, active.last_event_at, window) if active is not None else []
            if active is not None and joined:
                extra = Incident(id=active.id, node=subject, events=joined, scope=scope)
                self.rt.store.attach_events([extra])
                self.rt.store.open_incident(extra)
            joined_ids = {e.id for e in joined}
            fresh.extend(e for e in found if e.id not in joined_ids)
        return fresh

    def _active(self, subject: str, scope: Scope) -> IncidentRecord | None:
        # A node's closed incident means the node was dealt with: its next fault is new trouble.
        # A switch's storm goes on after its incident is handed to the network team; until it
        # has been quiet for a window, more of it is more evidence, not a second incident.
        statuses = (
            ACTIVE_INCIDENT_STATUSES
            if scope == "node"
            else ACTIVE_INCIDENT_STATUSES | TERMINAL_INCIDENT_STATUSES
        )
        return self.rt.store.find_active_incident(subject, statuses, scope)


def _within(events: list[FaultEvent], last: datetime, window: timedelta) -> list[FaultEvent]:
    """The events (time-sorted) that keep coming within `window` of the incident's last one."""
    joined = []
    for event in events:
        if event.time - last <= window:
            joined.append(event)
            last = max(last, event.time)
    return joined


def _run_flow(rt: Runtime, incident: Incident) -> None:
    asyncio.run(remediate_one(rt, incident))
