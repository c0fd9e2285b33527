"""The warm path: events `medic serve` has stored become incidents and flow runs in this process.

A new event joins its node's incident while that incident is still being handled and the event
falls within the policy's window, so the running flow sees the new evidence at its next
decision instead of a second flow run starting. Everything else is correlated into new
incidents, each remediated by its own flow run on a worker thread (flows run sync tasks; the
service's event loop must stay free to acknowledge events).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from datetime import timedelta

import anyio

from flows.dispatch import remediate_one
from medic.events import FaultEvent
from medic.incidents import Incident, correlate
from tasks.guard import ensure_limits
from tasks.runtime import Runtime

log = logging.getLogger("medic.live")
ACTIVE = ("open", "remediating", "waiting for approval")


class LiveDispatcher:
    def __init__(self, rt: Runtime, max_concurrent: int = 8) -> None:
        self.rt = rt
        self._limiter = anyio.CapacityLimiter(max_concurrent)
        self._runs: set[asyncio.Task[None]] = set()

    async def warm_up(self) -> None:
        """Start Prefect's API (embedded or remote) before the first fault needs it."""
        await ensure_limits()

    async def __call__(self, events: list[FaultEvent]) -> None:
        incidents = await anyio.to_thread.run_sync(self._correlate, events)
        for incident in incidents:
            task = asyncio.create_task(self._run(incident))
            self._runs.add(task)
            task.add_done_callback(self._runs.discard)

    async def drain(self) -> None:
        """Wait for the flow runs started so far (tests, shutdown)."""
        while self._runs:
            await asyncio.gather(*list(self._runs), return_exceptions=True)

    def _correlate(self, events: list[FaultEvent]) -> list[Incident]:
        store = self.rt.store
        window = timedelta(minutes=self.rt.policy().policy.defaults.incident_window_minutes)
        by_node: dict[str, list[FaultEvent]] = defaultdict(list)
        for event in sorted(events, key=lambda e: (e.time, e.id)):
            by_node[event.node].append(event)
        fresh: list[FaultEvent] = []
        for node, found in by_node.items():
            active = store.find_active_incident(node, ACTIVE)
            joined = []
            if active is not None:
                last = active.last_event_at
                for event in found:
                    if event.time - last <= window:
                        joined.append(event)
                        last = max(last, event.time)
            if joined:
                extra = Incident(id=active.id, node=node, events=joined)  # type: ignore[union-attr]
                store.attach_events([extra])
                store.open_incident(extra)
            joined_ids = {e.id for e in joined}
            fresh.extend(e for e in found if e.id not in joined_ids)
        incidents = correlate(fresh, window)
        store.attach_events(incidents)
        for incident in incidents:
            store.open_incident(incident)
        return incidents

    async def _run(self, incident: Incident) -> None:
        try:
            await anyio.to_thread.run_sync(_run_flow, self.rt, incident, limiter=self._limiter)
        except Exception:  # one incident's failure must not stop the service
            log.exception("remediation of %s failed", incident.id)


def _run_flow(rt: Runtime, incident: Incident) -> None:
    asyncio.run(remediate_one(rt, incident))
