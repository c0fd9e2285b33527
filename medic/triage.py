"""`medic triage`: events in, one decision per incident out, nothing acted on. No Prefect needed.

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
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter, deque
from collections.abc import Callable, Generator, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel, ConfigDict

from medic.ageing import PastIncident
from medic.context import Context, Seen, Trace, index_keys, series_key, trace
from medic.culprit import Differential
from medic.errors import MedicError
from medic.events import EventKind, FaultEvent
from medic.facts import HISTORY_WINDOW, RETURNS, TAKES_OUT, Facts, facts_of, taken_out_by_us
from medic.incidents import Incident, Scope, Storms, incident_id
from medic.intake import Rejection, bounded_lines, parse_line
from medic.policy import LoadedPolicy, Mode, Policy, decide, groups, guardrails
from medic.policy.guardrails import HOUR, Acting, FleetState, takes_node_out
from medic.policy.model import DESTRUCTIVE, Action, Decision
from medic.protocols import NodeInfo


class TriageLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    incident: str
    nodes: list[str]
    classification: Literal["hardware", "software", "infrastructure", "unknown"]
    action: Literal["none", "diagnose", "reset_gpu", "reboot", "replace", "drain", "reintegrate", "escalate"]
    diagnose_level: int | None
    rule: str
    reason: str
    # Added within schema version 1 (docs/triage.md): the node's group and mode, and why no group
    # could be told (the incident is then escalated, its mode observe).
    group: str | None = None
    mode: Literal["observe", "contain", "remediate"] = "remediate"
    group_problem: str | None = None


def triage_line(replayed: Replayed) -> TriageLine:
    decision = replayed.decision
    return TriageLine(
        incident=replayed.incident.id,
        nodes=replayed.incident.nodes,
        classification=decision.classification.value,
        action=decision.action.value,
        diagnose_level=decision.diagnose_level,
        rule=decision.rule,
        reason=decision.reason,
        group=decision.group,
        mode=decision.mode.value,
        group_problem=replayed.placement.problem,
    )


@dataclass(slots=True)
class _ReplayedFleet:
    """The fleet as the decisions so far would have left it: what the guardrails look at."""

    fleet_size: int | None
    out_of_service: set[str] = field(default_factory=set)
    destructive_at: list[datetime] = field(default_factory=list)
    last_destructive: dict[str, datetime] = field(default_factory=dict)
    taken_out_at: dict[str, datetime] = field(default_factory=dict)
    breaker_open: bool = False

    def state(self, now: datetime, opened: datetime) -> FleetState:
        # Incidents come in order of opening, and every later decision happens after `opened`:
        # actions more than an hour before it can never matter again. Dropping them keeps a
        # replay of a week of events linear. The snapshot shares the set and dicts (it is only
        # read): a copy of every node out of service, per decision, would cost more than deciding.
        self.destructive_at = [at for at in self.destructive_at if at >= opened - HOUR]
        return FleetState(
            now=now,
            fleet_size=self.fleet_size,
            out_of_service=self.out_of_service,
            destructive_at=tuple(self.destructive_at),
            last_destructive=self.last_destructive,
            taken_out_at=self.taken_out_at,
            breaker_open=self.breaker_open,
        )

    def record(self, node: str, now: datetime, decision: Acting) -> None:
        if decision.guardrail == "circuit_breaker":
            self.breaker_open = True
        if takes_node_out(decision):
            self.taken_out_at[node] = now
            self.out_of_service.add(node)
        if decision.action in DESTRUCTIVE:
            self.destructive_at.append(now)
            self.last_destructive[node] = now
        if decision.action in DESTRUCTIVE or decision.action is Action.REINTEGRATE:
            # The flow verifies a repaired node and returns it; a drain or a long
            # diagnostic keeps it out until a later decision says otherwise.
            self.out_of_service.discard(node)

    def forget_taken_out_before(self, moment: datetime) -> None:
        """Drop when nodes went out before `moment`: no later decision's breaker window reaches it."""
        self.taken_out_at = {node: at for node, at in self.taken_out_at.items() if at >= moment}


class GroupLimits:
    """Each node group's own guardrails, held over the decisions on its own nodes as a replay's
    decisions so far would have left them, after the policy's over the fleet (as `check_rails` in
    medic/tasks/nodes/evidence.py holds them live). How many nodes a group has is the scheduler's to say: only
    the count limits apply."""

    def __init__(self, policy: Policy) -> None:
        self.rails = {g.name: r for g in policy.groups if (r := groups.group_rails(policy, g)) is not None}
        self.fleets = {name: _ReplayedFleet(None) for name in self.rails}

    def check(
        self, group: str | None, now: datetime, opened: datetime, node: str, decision: Acting, scope: Scope
    ) -> tuple[str, str] | None:
        """The first of the group's limits the decision would break, as (name, why); None when all hold."""
        rails = self.rails.get(group) if group is not None else None
        if group is None or rails is None:
            return None
        hit = guardrails.check(rails, self.fleets[group].state(now, opened), node, decision, scope)
        return (hit[0], f"{hit[1]} in group {group}") if hit else None

    def record(self, group: str | None, node: str, now: datetime, decision: Acting) -> None:
        fleet = self.fleets.get(group) if group is not None else None
        if fleet is not None:
            fleet.record(node, now, decision)


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


class _Ids:
    """The event ids seen so far, exactly, in two flat arrays: each id's UTF-8 bytes after a
    two-byte length in one buffer, and an open-addressing table of where each starts. About 20
    bytes an id, where a set of strings costs about 100: the one thing triage keeps for the whole
    input, so that a repeated id is dropped wherever it comes. Ids are compared whole, so no two
    different ids are confused.

    A slot is a C unsigned int (four bytes) while the buffer is under 4 GiB, eight bytes past that:
    at a million ids the table is 8 MiB, not 16. No hash bits fit beside the start, so a probe
    compares the id itself; with at most half the slots used, an id new to the table (most are)
    meets one used slot on average."""

    __slots__ = ("_ids", "_slots", "_used")

    def __init__(self) -> None:
        self._ids = bytearray()
        self._slots = array("I", bytes(4 * 1024))  # 0: empty; else where the id starts, plus 1
        self._used = 0

    @property
    def nbytes(self) -> int:
        """The memory the two arrays take."""
        return len(self._ids) + len(self._slots) * self._slots.itemsize

    def add(self, event_id: str) -> bool:
        """Remember `event_id`: True if it is new."""
        data = event_id.encode("utf-8", "surrogatepass")  # ids are at most 200 characters
        stored = len(data).to_bytes(2, "little") + data  # as the buffer holds it
        entry = len(self._ids) + 1
        if entry >= WIDE_FROM and self._slots.typecode == "I":
            self._slots = array("Q", self._slots)
        if not self._put(stored, entry):
            return False
        self._ids += stored
        self._used += 1
        if self._used * 2 > len(self._slots):
            self._grow()
        return True

    def _put(self, stored: bytes, entry: int) -> bool:
        """Put `entry` in the first free slot for the id `stored` (its length, then its bytes),
        unless the id is there already."""
        slots, ids = self._slots, self._ids
        mask = len(slots) - 1
        index = hash(stored) & mask
        while found := slots[index]:
            if ids[found - 1 : found - 1 + len(stored)] == stored:
                return False
            index = (index + 1) & mask
        slots[index] = entry
        return True

    def _grow(self) -> None:
        old = self._slots
        self._slots = array(old.typecode, bytes(2 * len(old) * old.itemsize))
        ids = self._ids
        for found in old:
            if found:
                end = found + 1 + int.from_bytes(ids[found - 1 : found + 1], "little")
                self._put(bytes(ids[found - 1 : end]), found)


WIDE_FROM = 2 ** (8 * array("I").itemsize)  # the first slot value (a start, plus 1) "I" cannot hold


@dataclass(slots=True)
class EventReader:
    """A file's events, one line at a time, as `medic.intake.read_file` takes them: blank lines
    skipped, an id seen before dropped (and kept in `duplicates`). `chars` counts what has been
    read, for progress."""

    handle: IO[str]
    name: str
    rejected: int = 0
    duplicates: list[str] = field(default_factory=list)
    chars: int = 0

    def __enter__(self) -> EventReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.handle.close()

    def events(self, on_rejected: Callable[[Rejection], None]) -> Generator[FaultEvent]:
        """The events, in file order; a line that is not an event goes to `on_rejected` as it comes."""
        seen = _Ids()
        differential = Differential()  # as medic.intake.read_lines: culprits, not victims
        for number, raw in enumerate(bounded_lines(self.handle), start=1):
            self.chars += len(raw)
            text = raw.strip()
            if not text:
                continue
            parsed = parse_line(text, f"{self.name}:{number}")
            if isinstance(parsed, Rejection):
                self.rejected += 1
                on_rejected(parsed)
            elif not seen.add(parsed.id):
                self.duplicates.append(parsed.id)
            else:
                yield from differential.push(parsed)
        yield from differential.flush()


def read_file(path: Path) -> EventReader:
    """`path` opened to be read one event at a time; raises `OSError` when it cannot be opened.

    The streaming twin of `medic.intake.read_file`, which reads the whole file at once."""
    # utf-8-sig and replace, as medic.intake.read_file: the same text gives the same events.
    return EventReader(path.open(encoding="utf-8-sig", errors="replace"), str(path))


# Times in the stream are integer microseconds since the epoch: the same order as the aware
# datetimes, without the time-zone arithmetic each datetime comparison costs.
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)
Key = tuple[int, str]  # (time, id): the order of events, and of incidents by their first event


def _micros(moment: datetime) -> int:
    return (moment - EPOCH) // MICROSECOND


def _order(event: FaultEvent) -> tuple[datetime, str]:
    return event.time, event.id


def _lookbacks(policy: Policy) -> dict[EventKind, timedelta]:
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


class _Recent(Context):
    """The context of a stream: events added in time order, dropped once no decision to come can
    look back at them. Only the kinds some condition counts are kept (no other is ever asked for),
    each event as a `Trace` of what those conditions read. Indexed as `Context` indexes (by kind, and
    by kind and node, job, switch or mark)."""

    def __init__(self, lookbacks: dict[EventKind, timedelta], fleet_size: int | None) -> None:
        super().__init__(fleet_size=fleet_size)
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
        low, high = _micros(start), _micros(end)
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
        low, high = _micros(start), _micros(end)
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
        self.context = _Recent(_lookbacks(policy), fleet_size)
        self.fleet = _ReplayedFleet(fleet_size)
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
        key = (_micros(event.time), event.id)
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
            heapq.heappush(self.ready, ((_micros(first.time), first.id), self._next(), incident))

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
