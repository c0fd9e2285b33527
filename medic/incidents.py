"""Grouping events into incidents: one incident per node per burst of trouble, or one per switch storm.

A storm of events about one node must become one incident (and so one flow run), not hundreds.
An event joins its node's open incident when it comes within `window` of that incident's last
event, otherwise it opens a new one. `remediation` events are the node's history, not trouble:
they never open an incident. Nor do `node_state` events (what people did to a node, as the
scheduler records it): they are evidence for the rollout report, kept in the store only.

Trouble under one leaf switch from many nodes at once is the network's, and deciding on it node
by node is how one bad switch becomes 32 drained nodes. So the events the policy's `switch`
conditions count (`Storms`), when they meet such a condition, become ONE incident about the
switch: its `node` is the switch's name and its `scope` is "switch".
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from medic.events import EventKind, FaultEvent

DEFAULT_WINDOW = timedelta(minutes=10)
Scope = Literal["node", "switch"]


# A fault's copies (resent, or reported by a second source) share its node, GPU, kind and what names the
# fault within its kind: an XID's number, a DCGM error, a failed health check. Nothing else: a copy's
# message text, counters and source may differ.
Signature = tuple[str, int | None, object]
# A straggler is named by its cause once its pair's verdict is in (medic/pair_profiles.py): the same
# rank slow for the same reason again is the same finding.
_NAMED_BY = ("code", "error_id", "check", "straggler_cause")
# The verdicts that clear the node (medic/profile_diff.py `Cause`): the rank is slow for its job's own
# reasons, so an incident that left the node alone holds its later stragglers too (docs/decisions/0024).
NODE_CLEARED_CAUSES = frozenset({"software-input", "software-python"})


def fault_signature(kind: str, gpu: int | None, attributes: Mapping[str, Any] | None) -> Signature:
    named = attributes or {}
    return (str(kind), gpu, next((named[k] for k in _NAMED_BY if k in named), None))


def copies_of_handled(
    events: Iterable[FaultEvent],
    evidence: Iterable[tuple[Signature, datetime]],
    window: timedelta,
    held: bool,
) -> bool:
    """Whether `events` are more of a handled incident's fault, arriving after it acted (docs/decisions/0013):
    each has a signature of the incident's `evidence` (its events' signatures and times) and, unless the
    incident still holds the node out of service, comes within `window` of the fault's latest evidence
    so far, the copies before it included: the burst goes on. A fault after a quiet `window` is a new
    episode, and a different fault is a new incident."""
    seen = list(evidence)
    signatures = {signature for signature, _ in seen}
    if not seen:
        return False
    last = max(at for _, at in seen)
    for event in sorted(events, key=lambda e: e.time):
        if fault_signature(event.kind, event.gpu, event.attributes) not in signatures:
            return False
        if not held and event.time - last > window:
            return False
        last = max(last, event.time)
    return True


def cleared_stragglers(events: Iterable[FaultEvent]) -> bool:
    """Whether `events` are all stragglers whose verdict clears their node: more of a finding an
    incident already made and left the node alone for, not a fault to judge again."""
    found = list(events)
    return bool(found) and all(
        e.kind is EventKind.STRAGGLER and e.attributes.get("straggler_cause") in NODE_CLEARED_CAUSES
        for e in found
    )


def incident_id(node: str, first_event_id: str) -> str:
    """Stable across replays of the same events, so re-ingesting a file never opens a twin."""
    digest = hashlib.sha256(f"{node}\0{first_event_id}".encode()).hexdigest()[:10]
    return f"inc-{digest}"


@dataclass(slots=True)
class Incident:
    id: str
    node: str  # the switch's name when scope is "switch"
    events: list[FaultEvent] = field(default_factory=list)
    history: list[FaultEvent] = field(default_factory=list)
    scope: Scope = "node"

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

    @property
    def subject(self) -> str:
        """What the incident is about, for people: `gpu-017`, or `switch leaf-3 (32 nodes)`."""
        return f"switch {self.node} ({len(self.nodes)} nodes)" if self.scope == "switch" else self.node

    def add(self, event: FaultEvent) -> None:
        self.events.append(event)


@dataclass(frozen=True, slots=True)
class StormRule:
    """One policy `switch` condition: these kinds from this many nodes under a switch within `within`."""

    kinds: frozenset[EventKind]
    within: timedelta
    nodes_at_least: int | None = None
    fraction_at_least: float | None = None

    def met(self, nodes: int, switch_size: int | None) -> bool:
        # The same test as the policy engine's `switch` condition, so what correlation calls a
        # storm is what the rule then decides on.
        enough = self.nodes_at_least is not None and nodes >= self.nodes_at_least
        share = (
            self.fraction_at_least is not None
            and switch_size is not None
            and switch_size > 0
            and nodes / switch_size >= self.fraction_at_least
        )
        return enough or share

    def holds_in(self, events: list[FaultEvent], switch_size: int | None) -> bool:
        """Whether some span of `within` holds enough distinct nodes (events sorted by time)."""
        counted = [e for e in events if e.kind in self.kinds]
        nodes: Counter[str] = Counter()
        start = 0
        for event in counted:
            nodes[event.node] += 1
            while event.time - counted[start].time > self.within:
                gone = counted[start].node
                nodes[gone] -= 1
                if not nodes[gone]:
                    del nodes[gone]
                start += 1
            if self.met(len(nodes), switch_size):
                return True
        return False


@dataclass(frozen=True, slots=True)
class Storms:
    """What makes trouble under one switch one incident; no rules: every incident is one node's."""

    rules: tuple[StormRule, ...] = ()
    switch_sizes: Mapping[str, int] = field(default_factory=dict)

    @property
    def kinds(self) -> frozenset[EventKind]:
        return frozenset().union(*(r.kinds for r in self.rules))

    def counts(self, event: FaultEvent) -> bool:
        """Whether the event could be part of a switch storm."""
        return event.switch is not None and event.kind in self.kinds

    def is_storm(self, switch: str, events: list[FaultEvent]) -> bool:
        size = self.switch_sizes.get(switch)
        return any(rule.holds_in(events, size) for rule in self.rules)


NO_STORMS = Storms()


def _bursts(events: list[FaultEvent], window: timedelta) -> Iterable[list[FaultEvent]]:
    """Split time-sorted events where more than `window` passes without one."""
    burst: list[FaultEvent] = []
    for event in events:
        if burst and event.time - burst[-1].time > window:
            yield burst
            burst = []
        burst.append(event)
    if burst:
        yield burst


def _switch_storms(
    ordered: list[FaultEvent], window: timedelta, storms: Storms
) -> tuple[list[Incident], set[str]]:
    by_switch: dict[str, list[FaultEvent]] = defaultdict(list)
    for event in ordered:
        if event.switch is not None and storms.counts(event):
            by_switch[event.switch].append(event)
    incidents: list[Incident] = []
    taken: set[str] = set()
    for switch, candidates in by_switch.items():
        for burst in _bursts(candidates, window):
            if storms.is_storm(switch, burst):
                incidents.append(
                    Incident(
                        id=incident_id(f"switch:{switch}", burst[0].id),
                        node=switch,
                        events=burst,
                        scope="switch",
                    )
                )
                taken.update(e.id for e in burst)
    return incidents, taken


def correlate(
    events: Iterable[FaultEvent], window: timedelta = DEFAULT_WINDOW, storms: Storms = NO_STORMS
) -> list[Incident]:
    """Group events (any order) into incidents, oldest first. Pure: same input, same ids."""
    # People's actions are no trouble, whatever a policy's storm kinds say (docs/decisions/0019).
    ordered = sorted((e for e in events if e.kind is not EventKind.NODE_STATE), key=lambda e: (e.time, e.id))
    incidents, taken = _switch_storms(ordered, window, storms) if storms.rules else ([], set())
    history: dict[str, list[FaultEvent]] = {}
    open_by_node: dict[str, Incident] = {}
    for event in ordered:
        if event.id in taken:
            continue
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
        if incident.scope == "node":
            incident.history = [h for h in history.get(incident.node, []) if h.time <= incident.last_at]
    incidents.sort(key=lambda i: (i.opened_at, i.events[0].id))
    return incidents
