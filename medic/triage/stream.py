"""`medic triage`'s engine: events in, one decision per incident out, nothing acted on. No Prefect needed.

The JSON form of `TriageLine` is a public contract (docs/triage.md); tests pin it.

Triage streams. Events are taken in time order, and an incident is decided as soon as nothing
later in the input can change it: its node has been quiet for the correlation window, no switch
storm can still claim its events, and every incident opened before it has been decided (the
guardrails replay decisions in the order incidents opened). Memory holds the events of the
correlation window, the events cross-node conditions can still look back at (per kind, as far as
the policy's `count` and `switch` conditions reach), the remediations of the last week and the
incidents waiting for an older one: not the input. The result is the batch one: `correlate` over
every event, decided with every event as the context.

Each incident is decided in its node's group and mode as the live path decides it
(medic/policy/groups.py: `place_all`, `policy_for`, `in_mode`), on what triage knows of the node:
its name, and what the caller says the scheduler says of it (`nodes`). A group whose selector needs
a fact not given cannot be told, and the incident escalates, as a live one does.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from medic.ageing import PastIncident
from medic.errors import MedicError
from medic.events import EventKind, FaultEvent
from medic.facts import HISTORY_WINDOW, RETURNS, TAKES_OUT, Facts, facts_of, taken_out_by_us
from medic.incidents import Incident, Storms, incident_id
from medic.policy import LoadedPolicy, Mode, decide, groups, guardrails
from medic.policy.model import Decision
from medic.protocols import NodeInfo
from medic.triage.fleet import ReplayedFleet
from medic.triage.limits import GroupLimits
from medic.triage.recent import MICROSECOND, Key, RecentWindow, lookbacks, micros


@dataclass(frozen=True, slots=True)
class Replayed:
    """One decision of a replay. The incident's `history` holds the node's remediations that can
    still matter to it: those of the last seven days, and the latest that took it out or returned it."""

    incident: Incident
    facts: Facts
    decision: Decision  # in the node's mode: in observe mode what would have been done (`groups.observed`)
    placement: groups.Placement  # the node's group and mode, and why


class OutOfOrder(MedicError, ValueError):
    """Raised when a streamed event is older than one already passed on by more than the slack
    allowed for, so the stream cannot be put back in time order; `replay` takes any order."""


def replay(
    events: Iterable[FaultEvent],
    loaded: LoadedPolicy,
    fleet_size: int | None = None,
    nodes: Sequence[NodeInfo] = (),
) -> Iterator[Replayed]:
    """Decide on each incident in time order, as the flows would, without acting.

    Cross-node conditions see every event of the input; guardrails see the fleet as the earlier
    decisions would have left it. Without `fleet_size` only the count limits apply. Each incident is
    decided in its node's group and mode, placed on what `nodes` say of it (as the scheduler's
    records would), else on its name alone. The events may come in any order (they are sorted
    first); `stream` takes them already in order.
    """
    return stream(sorted(events, key=_order), loaded, fleet_size, nodes=nodes)


def stream(
    events: Iterable[FaultEvent],
    loaded: LoadedPolicy,
    fleet_size: int | None = None,
    slack: timedelta | None = None,
    nodes: Sequence[NodeInfo] = (),
) -> Iterator[Replayed]:
    """`replay` over events that come in time order, each decision out as soon as it is final.

    An event may come up to `slack` (default: the policy's incident window) after a later one;
    one that comes later than that raises `OutOfOrder`.
    """
    streaming = Stream(loaded, fleet_size, slack, nodes=nodes)
    for event in events:
        yield from streaming.push(event)
    yield from streaming.finish()


def triage(
    events: Iterable[FaultEvent], loaded: LoadedPolicy, fleet_size: int | None = None
) -> Iterator[tuple[Incident, Decision]]:
    for replayed in replay(events, loaded, fleet_size):
        yield replayed.incident, replayed.decision


def _order(event: FaultEvent) -> tuple[datetime, str]:
    return event.time, event.id


@dataclass(slots=True)
class _Burst:
    """Events a switch condition counts, under one switch, none more than the window after the last."""

    switch: str
    last: int  # time of the latest event
    events: list[FaultEvent] = field(default_factory=list)
    storm: bool | None = None  # None until nothing more can join


@dataclass(slots=True)
class _Open:
    """A node's open incident, with the times its correlation looks at."""

    incident: Incident
    first: Key
    last: int


@dataclass(slots=True)
class _History:
    """A node's remediations that can still matter: the last week's, and the latest that took it
    out or returned it before that (what `taken_out_by_us` goes by, however old)."""

    before: FaultEvent | None = None
    recent: deque[tuple[int, FaultEvent]] = field(default_factory=deque)

    def add(self, at: int, event: FaultEvent, horizon: int) -> None:
        self.recent.append((at, event))
        while self.recent[0][0] < horizon:
            _, old = self.recent.popleft()
            if old.attributes.get("action") in TAKES_OUT | RETURNS:
                self.before = old

    def until(self, moment: int) -> list[FaultEvent]:
        kept = [] if self.before is None else [self.before]
        return kept + [event for at, event in self.recent if at <= moment]


class Stream:
    """`correlate`, `facts_of`, `decide` and the guardrails, one event at a time (see the module's
    docstring). Events pass three stages: a reorder buffer (`slack`), switch storms (an event a
    `switch` condition counts waits until its burst is over and known to be a storm or not, and
    every event after it with it), and node incidents. Closed incidents wait in `ready` for their
    turn, in the order they opened. Heaps of deadlines are lazy: an entry is dropped when popped
    if its burst or incident has grown since."""

    def __init__(
        self,
        loaded: LoadedPolicy,
        fleet_size: int | None = None,
        slack: timedelta | None = None,
        prune_every: int = 1024,  # events between two prunings of the context
        nodes: Sequence[NodeInfo] = (),  # what the scheduler says of nodes, for their groups
    ) -> None:
        policy = self.policy = loaded.policy
        self.sha256 = loaded.sha256
        self.nodes = nodes
        window = timedelta(minutes=policy.defaults.incident_window_minutes)
        self.window = window // MICROSECOND
        self.slack = (window if slack is None else slack) // MICROSECOND
        self.storms: Storms = policy.storms()
        self.storm_kinds = self.storms.kinds
        breaker = policy.guardrails.circuit_breaker
        self.breaker_window = timedelta(minutes=breaker.window_minutes if breaker else 0)
        self.context = RecentWindow(lookbacks(policy), fleet_size)
        self.fleet = ReplayedFleet(fleet_size)
        self.group_limits = GroupLimits(policy)
        self.prune_every = prune_every
        self.since_pruning = 0
        # Stage 1: the reorder buffer, the latest time seen, and the last event passed on.
        self.pending: list[tuple[int, str, FaultEvent]] = []
        self.latest = -(2**63)
        self.passed: Key | None = None
        # Stage 2: events in order, held while a storm may still take one of them; open bursts.
        self.held: deque[tuple[int, FaultEvent, _Burst | None]] = deque()
        self.bursts: dict[str, _Burst] = {}
        self.burst_ends: list[tuple[int, int, _Burst]] = []
        # Stage 3: node incidents, open by node, by first event and by when they close; history.
        self.open: dict[str, _Open] = {}
        self.open_keys: list[tuple[Key, int, _Open]] = []
        self.open_ends: list[tuple[int, int, _Open]] = []
        self.history: dict[str, _History] = {}
        # Decided incidents that named a GPU, per node, as far back as `gpu_incidents` looks.
        self.gpu_reach = policy.gpu_history_lookback()
        self.gpu_history: dict[str, deque[PastIncident]] = {}
        # Closed incidents not yet decided, in the order they opened.
        self.ready: list[tuple[Key, int, Incident]] = []
        self.serial = 0  # tie-break for heap entries (incidents and bursts do not compare)

    def _next(self) -> int:
        self.serial += 1
        return self.serial

    @property
    def held_events(self) -> int:
        """Events held right now, in the buffers and the incidents not yet decided."""
        open_events = sum(len(o.incident.events) for o in self.open.values())
        ready_events = sum(len(i.events) for _, _, i in self.ready)
        return len(self.pending) + len(self.held) + open_events + ready_events

    def push(self, event: FaultEvent) -> Iterator[Replayed]:
        key = (micros(event.time), event.id)
        if self.passed is not None and key < self.passed:
            raise OutOfOrder(
                f"event {event.id} at {event.time.isoformat()} comes after a later one passed on: "
                f"more than {timedelta(microseconds=self.slack)} out of time order"
            )
        heapq.heappush(self.pending, (*key, event))
        self.latest = max(self.latest, key[0])
        while self.pending and self.pending[0][0] < self.latest - self.slack:
            self._pass(heapq.heappop(self.pending))
        return self._decide_ready()

    def finish(self) -> Iterator[Replayed]:
        while self.pending:
            self._pass(heapq.heappop(self.pending))
        for burst in list(self.bursts.values()):
            self._settle(burst)
        self._release_held()
        for entry in list(self.open.values()):
            self._close(entry)
        return self._decide_ready()

    def _pass(self, item: tuple[int, str, FaultEvent]) -> None:
        """Stage 2: an event in time order."""
        at, _, event = item
        self.passed = item[:2]
        self.context.add(event, at)
        if event.kind is EventKind.NODE_STATE:
            return  # what people did: context for count rules, never an incident (docs/decisions/0019)
        burst = None
        if event.switch is not None and event.kind in self.storm_kinds:
            burst = self.bursts.get(event.switch)
            if burst is None or at - burst.last > self.window:
                if burst is not None:
                    self._settle(burst)
                burst = self.bursts[event.switch] = _Burst(event.switch, at)
            burst.events.append(event)
            burst.last = at
            heapq.heappush(self.burst_ends, (at + self.window, self._next(), burst))
        self.held.append((at, event, burst))
        while self.burst_ends and self.burst_ends[0][0] < at:
            ended = heapq.heappop(self.burst_ends)[2]
            if ended.storm is None and ended.last + self.window < at:
                self._settle(ended)
        self._release_held()
        self.since_pruning += 1
        if self.since_pruning >= self.prune_every:
            self._prune()

    def _settle(self, burst: _Burst) -> None:
        burst.storm = self.storms.is_storm(burst.switch, burst.events)
        if self.bursts.get(burst.switch) is burst:
            del self.bursts[burst.switch]
        if burst.storm:
            first = burst.events[0]
            incident = Incident(
                id=incident_id(f"switch:{burst.switch}", first.id),
                node=burst.switch,
                events=burst.events,
                scope="switch",
            )
            heapq.heappush(self.ready, ((micros(first.time), first.id), self._next(), incident))

    def _release_held(self) -> None:
        while self.held and (self.held[0][2] is None or self.held[0][2].storm is not None):
            at, event, burst = self.held.popleft()
            if burst is None or not burst.storm:
                self._node_event(at, event)

    def _node_event(self, at: int, event: FaultEvent) -> None:
        """Stage 3: an event no storm took, in time order."""
        while self.open_ends and self.open_ends[0][0] < at:
            ended = heapq.heappop(self.open_ends)[2]
            if self.open.get(ended.incident.node) is ended and ended.last + self.window < at:
                self._close(ended)
        if event.kind is EventKind.REMEDIATION:
            # Older than the oldest week a decision to come looks at: every incident still open
            # on the node has its last event within the window.
            horizon = at - self.window - HISTORY_WINDOW // MICROSECOND
            self.history.setdefault(event.node, _History()).add(at, event, horizon)
            return
        entry = self.open.get(event.node)
        if entry is None or at - entry.last > self.window:
            if entry is not None:
                self._close(entry)
            incident = Incident(id=incident_id(event.node, event.id), node=event.node)
            entry = self.open[event.node] = _Open(incident, (at, event.id), at)
            heapq.heappush(self.open_keys, (entry.first, self._next(), entry))
        entry.incident.add(event)
        entry.last = at
        heapq.heappush(self.open_ends, (at + self.window, self._next(), entry))

    def _close(self, entry: _Open) -> None:
        incident = entry.incident
        del self.open[incident.node]
        history = self.history.get(incident.node)
        incident.history = history.until(entry.last) if history else []
        heapq.heappush(self.ready, (entry.first, self._next(), incident))

    def _oldest_open(self) -> Key | None:
        keys = self.open_keys
        while keys and self.open.get(keys[0][2].incident.node) is not keys[0][2]:
            heapq.heappop(keys)  # closed since
        return keys[0][0] if keys else None

    def _first_unsettled(self) -> Key | None:
        """The earliest an incident not yet closed can have opened: no later one may be decided."""
        held = (self.held[0][0], self.held[0][1].id) if self.held else None
        pending = self.pending[0][:2] if self.pending else None
        return min((k for k in (self._oldest_open(), held, pending) if k is not None), default=None)

    def _decide_ready(self) -> Iterator[Replayed]:
        # `_first_unsettled`, one source at a time: this runs for every event.
        while self.ready:
            first = self.ready[0][0]
            oldest = self._oldest_open()
            if (
                (oldest is not None and oldest < first)
                or (self.held and (self.held[0][0], self.held[0][1].id) < first)
                or (self.pending and self.pending[0][:2] < first)
            ):
                return
            yield self._decide(heapq.heappop(self.ready)[2])

    def _decide(self, incident: Incident) -> Replayed:
        now = incident.last_at
        self.fleet.forget_taken_out_before(incident.opened_at - self.breaker_window)
        # Out of service as the earlier decisions would have left it, or as the input records it:
        # a drain or reboot of ours that nothing returned, as the live path reads the scheduler.
        out = incident.node in self.fleet.out_of_service or taken_out_by_us(incident.history)
        facts = facts_of(
            incident, out_of_service=out, context=self.context, gpu_history=self._gpu_history(incident)
        )
        # The node's group and mode, as the live path's `evaluate` (medic/tasks/nodes/evidence.py) places it.
        placement = groups.place_all(
            self.policy, incident.nodes if incident.scope == "switch" else [incident.node], self.nodes
        )
        decided = decide(groups.policy_for(self.policy, placement.group), facts, self.sha256)
        decision = groups.in_mode(self._guarded(incident, placement.group_name, decided, now), placement)
        if placement.mode is not Mode.OBSERVE:  # a node only watched is left as it was (no breaker either)
            self.fleet.record(incident.node, now, decision)
            self.group_limits.record(placement.group_name, incident.node, now, decision)
        if self.gpu_reach and incident.scope == "node" and facts.gpus:
            past = PastIncident.of(incident, decision.classification.value)
            self.gpu_history.setdefault(incident.node, deque()).append(past)
        return Replayed(incident, facts, decision, placement)

    def _guarded(self, incident: Incident, group: str | None, decided: Decision, now: datetime) -> Decision:
        """The decision as the guardrails let it be: the policy's over the fleet, then the group's."""
        state = self.fleet.state(now, incident.opened_at)
        stopped = guardrails.check(
            self.policy.guardrails, state, incident.node, decided, incident.scope
        ) or self.group_limits.check(group, now, incident.opened_at, incident.node, decided, incident.scope)
        return decided if stopped is None else guardrails.stop(decided, stopped)

    def _gpu_history(self, incident: Incident) -> tuple[PastIncident, ...]:
        """The node's incidents decided before this one, within reach. Every later decision is of
        an incident opened later, so what is out of reach from this one's opening is gone for good."""
        past = self.gpu_history.get(incident.node)
        if not past:
            return ()
        while past and past[0].opened_at < incident.opened_at - self.gpu_reach:
            past.popleft()
        return tuple(past)

    def _prune(self) -> None:
        """Forget context no decision to come can reach: each ends no earlier than its incident
        opened, and none can have opened before the oldest incident or event still held."""
        self.since_pruning = 0
        oldest = [
            key[0] for key in (self._first_unsettled(), self.ready[0][0] if self.ready else None) if key
        ]
        if self.passed is not None:
            oldest.append(self.passed[0])
        self.context.forget_before(min(oldest))
