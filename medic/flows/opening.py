"""Opening incidents on the warm path: events correlated into incidents, each opened in the store or
joined to its node's active one (the store keeps one per node, whichever replica opened it), a storm's
events joined to its switch's incident while the storm goes on within the policy's window."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from medic.events import FaultEvent
from medic.flows.dispatch import stored
from medic.flows.leases import Leases
from medic.incidents import Incident, Storms, correlate
from medic.statuses import ACTIVE_INCIDENT_STATUSES, TERMINAL_INCIDENT_STATUSES
from medic.store.tables import IncidentRecord
from medic.tasks.nodes.evidence import storms
from medic.tasks.runtime import prefect_events
from medic.tasks.runtime.process import Runtime


class IncidentOpener:
    """Opens (or joins) the incidents of a batch of events for one process, holding the lease of
    each it now runs."""

    def __init__(self, rt: Runtime, leases: Leases) -> None:
        self.rt = rt
        self.leases = leases

    def correlate(self, events: list[FaultEvent]) -> list[Incident]:
        """Open (or join) the incidents for these events; returns those this process now runs."""
        opened = (self.open_one(incident) for incident in self.incidents(events))
        return [incident for incident in opened if incident is not None]

    def incidents(self, events: list[FaultEvent]) -> list[Incident]:
        """The incidents these events make, once those of a storm still going on joined it."""
        policy = self.rt.policy().policy
        window = timedelta(minutes=policy.defaults.incident_window_minutes)
        current = policy.storms()
        if any(current.counts(e) for e in events):
            current = storms(self.rt)  # the scheduler's switch sizes, asked only when they matter
        return correlate(self._join_storms(events, window, current), window, current)

    def open_one(self, incident: Incident) -> Incident | None:
        """Open (or join) one incident; the incident when this process now runs it."""
        window = timedelta(minutes=self.rt.policy().policy.defaults.incident_window_minutes)
        row, opened = self.rt.store.open_or_join(
            incident, runner=self.leases.runner, lease_s=self.leases.lease_s, window=window
        )
        if opened:
            self.leases.hold(row.id)
            prefect_events.incident_opened(incident)
            return incident
        if self.leases.claim(row.id):
            # It joined an incident whose run died: new evidence never waits on a dead run.
            return stored(row)
        return None

    def _join_storms(self, events: list[FaultEvent], window: timedelta, current: Storms) -> list[FaultEvent]:
        """Attach a storm's events to its switch's incident while the storm goes on; return the rest."""
        switches = {e.switch for e in events if current.counts(e) and e.switch}
        storming = {s: found for s in switches if (found := self._switch_incident(s)) is not None}
        by_switch: dict[str, list[FaultEvent]] = defaultdict(list)
        fresh: list[FaultEvent] = []
        for event in sorted(events, key=lambda e: (e.time, e.id)):
            if current.counts(event) and event.switch in storming:
                by_switch[event.switch].append(event)
            else:
                fresh.append(event)
        for switch, switch_events in by_switch.items():
            active = storming[switch]
            joined = _within(switch_events, active.last_event_at, window)
            if joined:
                extra = Incident(id=active.id, node=switch, events=joined, scope="switch")
                self.rt.store.open_incident(extra)
            joined_ids = {e.id for e in joined}
            fresh.extend(e for e in switch_events if e.id not in joined_ids)
        return sorted(fresh, key=lambda e: (e.time, e.id))

    def _switch_incident(self, switch: str) -> IncidentRecord | None:
        # A switch's storm goes on after its incident is handed to the network team; until it
        # has been quiet for a window, more of it is more evidence, not a second incident.
        statuses = ACTIVE_INCIDENT_STATUSES | TERMINAL_INCIDENT_STATUSES
        return self.rt.store.find_active_incident(switch, statuses, "switch")

    def held_elsewhere(self, switch: str, mine: list[FaultEvent]) -> list[FaultEvent]:
        """The storm's events that other replicas stored and still hold. A load balancer gives each
        replica a share of a switch's events, and a share of a storm may fall under the policy's
        `fraction_at_least` where the whole is over it: each replica would open node incidents for
        a switch's trouble (BENCHMARKS.md, "At fleet scale", burst (c)). Whichever replica opens
        the switch's incident first ties them all; the others' then join it."""
        policy = self.rt.policy().policy
        since = min(e.time for e in mine) - timedelta(minutes=policy.defaults.incident_window_minutes)
        held = {e.id for e in mine}
        found = self.rt.store.unassigned_on_switch(switch, policy.storms().kinds, since)
        return [e for e in found if e.id not in held]


def _within(events: list[FaultEvent], last: datetime, window: timedelta) -> list[FaultEvent]:
    """The events (time-sorted) that keep coming within `window` of the incident's last one."""
    joined = []
    for event in events:
        if event.time - last <= window:
            joined.append(event)
            last = max(last, event.time)
    return joined
