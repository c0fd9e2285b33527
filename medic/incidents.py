"""Grouping events into incidents: one incident per node per burst of trouble.

A storm of events about one node must become one incident (and so one flow run), not
hundreds. v1 correlates by node: an event joins the node's open incident when it comes
within `window` of that incident's last event, otherwise it opens a new one.
`remediation` events are the node's history, not trouble: they never open an incident.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from medic.events import EventKind, FaultEvent

DEFAULT_WINDOW = timedelta(minutes=10)


def incident_id(node: str, first_event_id: str) -> str:
    """Stable across replays of the same events, so re-ingesting a file never opens a twin."""
    digest = hashlib.sha256(f"{node}\0{first_event_id}".encode()).hexdigest()[:10]
    return f"inc-{digest}"


@dataclass(slots=True)
class Incident:
    id: str
    node: str
    events: list[FaultEvent] = field(default_factory=list)
    history: list[FaultEvent] = field(default_factory=list)

    @property
    def opened_at(self) -> datetime:
        return self.events[0].time

    @property
    def last_at(self) -> datetime:
        return self.events[-1].time

    @property
    def nodes(self) -> list[str]:
        return sorted({e.node for e in self.events})

    @property
    def jobs(self) -> list[str]:
        return sorted({e.job for e in self.events if e.job})

    @property
    def switch(self) -> str | None:
        return next((e.switch for e in self.events if e.switch), None)

    def add(self, event: FaultEvent) -> None:
        self.events.append(event)


def correlate(events: Iterable[FaultEvent], window: timedelta = DEFAULT_WINDOW) -> list[Incident]:
    """Group events (any order) into incidents, oldest first. Pure: same input, same ids."""
    ordered = sorted(events, key=lambda e: (e.time, e.id))
    history: dict[str, list[FaultEvent]] = {}
    open_by_node: dict[str, Incident] = {}
    incidents: list[Incident] = []
    for event in ordered:
        if event.kind is EventKind.REMEDIATION:
            history.setdefault(event.node, []).append(event)
            continue
        current = open_by_node.get(event.node)
        if current is None or event.time - current.last_at > window:
            current = Incident(id=incident_id(event.node, event.id), node=event.node)
            open_by_node[event.node] = current
            incidents.append(current)
        current.add(event)
    for incident in incidents:
        incident.history = [h for h in history.get(incident.node, []) if h.time <= incident.last_at]
    return incidents
