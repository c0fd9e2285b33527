"""`medic policy replay`: decide every recorded incident again with another policy, and compare.

Pure, like the engine: recorded decisions and stored events in, a report out. Each recorded
decision is made again by `decide` on the facts recorded with it (`FactsRecord`, kept in the
decision's row), then the new policy's guardrails are replayed in time order over the new
decisions, as `medic triage` replays them: the fleet is what the replayed decisions would have
left; the fleet size is the one recorded with each decision; an opened breaker stays open until
the time a human closed the real one. A decision recorded before facts were kept has its facts
rebuilt from the incident's stored events and the node's history, the way the flows build them,
and the report counts those.

Each incident is decided in its node's group and mode under the new policy, placed as the live path
places it (medic/policy/groups.py) on what the store knows of the node: its name. A group that turns
on the scheduler's facts (partitions, features, GPUs) cannot be told, and the incident escalates, as
a live one does.

The replay is made in two halves: `redecide` decides the recorded decisions again, which may be
split over processes by incident (medic/apps/cli/replay_parallel.py, `decided_as_one`), and `judge`
(medic/whatif/replay_report.py) replays the guardrails over all of them and makes the report, whose
JSON form is a public contract (docs/policy.md#replay); tests pin it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from operator import itemgetter
from typing import Any, NamedTuple, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, create_model, field_serializer, field_validator

from medic.context import Context
from medic.events import EventKind, FaultEvent
from medic.facts import Facts, facts_of, taken_out_by_us
from medic.incidents import Incident, Scope
from medic.policy import LoadedPolicy, Mode, groups
from medic.policy.engine import Ruling, ruling, window
from medic.whatif.replay_report import Outcome, Redecided, Redecisions, ReplayReport, judge

# Facts fields kept as they are; `events` is kept as the events' ids and `context` (the cluster's
# recent events) is rebuilt from the store, which holds every event for good.
_NOT_KEPT = frozenset({"events", "context"})


_KEPT = tuple(f.name for f in dataclasses.fields(Facts) if f.name not in _NOT_KEPT)
_FACTS_FIELDS = itemgetter(*(f.name for f in dataclasses.fields(Facts)))
_FACT_TYPES = get_type_hints(Facts)
# A set has no order; sorted, the same facts are always the same JSON.
_SETS = tuple(name for name in _KEPT if get_origin(_FACT_TYPES[name]) is frozenset)


class KeptFacts(BaseModel):
    """What a record of facts adds to the Facts fields it keeps: its format's version, the incident's
    events by id (the store holds every event for good) and the sizes the percentages were of."""

    model_config = ConfigDict(frozen=True)

    version: int = 1
    event_ids: tuple[str, ...]  # the incident's events at the time, oldest first
    fleet_size: int | None = None  # the guardrails' percentages were of this many nodes
    switch_size: int | None = None  # nodes under the incident's switch, for `fraction_at_least`

    @field_serializer(*_SETS, check_fields=False)
    def _sorted(self, values: frozenset[str] | frozenset[int]) -> list[str] | list[int]:
        return sorted(values)  # type: ignore[return-value]  # str or int, never mixed

    @field_validator("now", check_fields=False)
    @classmethod
    def _utc(cls, now: datetime) -> datetime:
        # Read back, a time carries pydantic's own tzinfo. Python compares times of two tzinfo objects
        # through their UTC offsets, several times slower than times of one, and the engine compares
        # `now` with the stored events' times (UTC) in every windowed condition it tests.
        return now.astimezone(UTC)


def _default(field: dataclasses.Field[object]) -> object:
    return ... if field.default is dataclasses.MISSING else field.default  # ...: required


# What the engine saw for one decision, as the `decisions.facts` column holds it: every field of Facts
# but `_NOT_KEPT`, derived from Facts itself, so a fact added there is kept and replayed with no second
# list to forget.
_KEPT_FIELDS: dict[str, Any] = {
    f.name: (_FACT_TYPES[f.name], _default(f)) for f in dataclasses.fields(Facts) if f.name in _KEPT
}
FactsRecord: type[KeptFacts] = create_model("FactsRecord", __base__=KeptFacts, **_KEPT_FIELDS)


def record_facts(facts: Facts) -> dict[str, object]:
    """The JSON the store keeps with a decision."""
    switch_size = facts.context.switch_sizes.get(facts.switch) if facts.switch else None
    record = FactsRecord(
        event_ids=tuple(e.id for e in facts.events),
        fleet_size=facts.context.fleet_size,
        switch_size=switch_size,
        **{name: getattr(facts, name) for name in _KEPT},
    )
    return record.model_dump(mode="json")


def facts_from(record: KeptFacts, events: Mapping[str, FaultEvent], context: Context) -> Facts:
    """The Facts a decision was made on, its events looked up among the stored ones."""
    # Facts' fields in order, from the record's values: a replay builds hundreds of thousands of
    # Facts, and passed by name they would cost half as much again.
    values = dict(record.__dict__, events=tuple(events[i] for i in record.event_ids), context=context)
    return Facts(*_FACTS_FIELDS(values))


class RecordedDecision(NamedTuple):
    """One row of the decisions table, with what replaying it needs from its incident. A tuple: a
    replay reads hundreds of thousands, and a frozen dataclass takes twice as long to build."""

    id: int  # the row's: of two decisions made at one moment, the one recorded first came first
    incident: str
    node: str  # the switch's name for a switch-wide incident
    scope: Scope
    decided_at: datetime
    outcome: Outcome  # as recorded: rule, action, level, guardrail
    facts: str | None  # a FactsRecord as JSON; None when recorded before facts were kept
    flow_run_id: str | None = None
    mode: Mode | None = None  # the mode it ran in; None: recorded before modes, acted on as remediate


@dataclass(frozen=True, slots=True)
class History:
    """What the store holds for a replay (medic/store/replay.py)."""

    decisions: Sequence[RecordedDecision]  # in the order they were made
    # Every event stored from `start` to `end` (the cluster's around the decisions) and the decisions'
    # incidents' earlier ones.
    events: Sequence[FaultEvent]
    incident_events: Mapping[str, Sequence[FaultEvent]]  # per incident, oldest first (to rebuild facts)
    remediations: Mapping[str, Sequence[FaultEvent]]  # per node, oldest first (to rebuild facts)
    breaker_closed_at: Sequence[datetime] = ()  # when humans closed the real breaker
    start: datetime | None = None
    end: datetime | None = None


def replay(history: History, loaded: LoadedPolicy, since: datetime | None = None) -> ReplayReport:
    """Decide each recorded decision again with `loaded`, in the order they were made, and compare."""
    return judge([redecide(history, loaded)], loaded, history.breaker_closed_at, since)


def redecide(history: History, loaded: LoadedPolicy) -> Redecisions:
    """Every recorded decision made again with `loaded`, before its guardrails (`judge` replays them)."""
    deciding = Redeciding(history, loaded)
    return deciding.summary(list(deciding))


class Redeciding:
    """`redecide` a decision at a time, in the order they were made: a process deciding part of a
    replay hands them over as they come (medic/apps/cli/replay_parallel.py), and `summary` says what they
    read once all are made."""

    def __init__(self, history: History, loaded: LoadedPolicy) -> None:
        self.history = history
        self.decider = _Decider(history, loaded)
        self.pairs = _recorded_outcomes(history.decisions)
        self.made = 0

    def __iter__(self) -> Iterator[Redecided]:
        decider, pairs = self.decider, self.pairs
        outcomes: dict[Ruling, Outcome] = {}
        last_of = {record.incident: i for i, (record, _) in enumerate(pairs)}
        for index, (record, before) in enumerate(pairs):
            decided = decider.decide(record)
            if decided is None:
                continue
            key, fleet_size, placement = decided
            # Decisions come in few outcomes (a rule, its action and level): one object each.
            after = outcomes.get(key)
            if after is None:
                after = outcomes[key] = Outcome(rule=key[0], action=key[1], diagnose_level=key[2])
            self.made += 1
            yield Redecided(
                record.decided_at,
                record.id,
                record.incident,
                record.node,
                record.scope,
                before,
                after,
                fleet_size,
                last_of[record.incident] == index,
                record.flow_run_id,
                record.mode is Mode.OBSERVE,
                placement.group_name,
                placement.mode,
                placement.problem is not None,
            )

    def summary(self, decisions: Sequence[Redecided]) -> Redecisions:
        """The decisions made, `decisions` (all or none of them), with what they read."""
        history, decider = self.history, self.decider
        held = (history.start, history.end) if history.start and history.end else None
        own = {record.incident for record in history.decisions}
        firsts = [
            events[0].time
            for incident, events in history.incident_events.items()
            if incident in own and events
        ]
        return Redecisions(
            decisions,
            rebuilt=decider.rebuilt,
            skipped=len(self.pairs) - self.made,
            held=held,
            read=decider.read,
            earliest=min(firsts, default=None),
            switch_sizes_recorded=decider.sizes_recorded,
            switch_sizes_missing=decider.sizes_missing,
        )


def decided_as_one(parts: Sequence[Redecisions], lookback: timedelta) -> bool:
    """Whether parts of a replay, decided apart on histories of their own, decided as one replay of
    all their incidents does, with the policy's conditions looking back `lookback` at most.

    A decision reads beyond its incident in three ways. Its windowed conditions read the cluster's
    events: one replay holds them from `lookback` before its first decision (and its incidents'
    earlier ones), a part only around its own decisions, so the windows must lie where both hold
    every event, or reach before the first where no other part's incident has events. Facts
    rebuilt read the node's history from the start of the part's history. And a decision with no
    size recorded for its switch is decided with the size recorded last before it, by whichever
    incident."""
    if any(part.rebuilt or part.skipped for part in parts):
        return False
    decided = [part for part in parts if part.decisions]
    start = min((part.decisions[0].decided_at for part in decided), default=None)
    for part in decided:
        if part.read is None or part.held is None or start is None:
            continue
        (held_from, held_to), (read_from, read_to) = part.held, part.read
        first = start - lookback
        if read_to > held_to:
            return False
        others = [p.earliest for p in decided if p is not part and p.earliest is not None]
        if read_from < max(held_from, first) and (held_from != first or min(others, default=first) < first):
            return False
    recorded = any(part.switch_sizes_recorded for part in parts)
    return not (recorded and any(part.switch_sizes_missing for part in parts))


def _rebuilt(record: RecordedDecision, history: History, context: Context) -> Facts | None:
    """Facts for a decision recorded without them: the incident's events and the node's history up to
    the decision, distilled as the flows distil them. Out of service as the history leaves the node."""
    events = [e for e in history.incident_events.get(record.incident, ()) if e.time <= record.decided_at]
    if not events:
        return None
    incident = Incident(record.incident, record.node, events, scope=record.scope)
    if record.scope == "node":
        incident.history = [
            h
            for h in history.remediations.get(record.node, ())
            if h.time <= record.decided_at and h.attributes.get("incident") != record.incident
        ]
    out = taken_out_by_us(incident.history)
    return facts_of(incident, out_of_service=out, now=record.decided_at, context=context)


def _recorded_outcomes(records: Sequence[RecordedDecision]) -> list[tuple[RecordedDecision, Outcome]]:
    """Each decision to replay with the outcome that was recorded for it. A row without facts right
    after one of the same incident with facts is that decision stopped at the last check before its
    action (a guardrail under the slot): it is the earlier decision's recorded outcome, not a new one."""
    pairs: list[tuple[RecordedDecision, Outcome]] = []
    last: dict[str, int] = {}
    for record in records:
        previous = last.get(record.incident)
        if record.facts is None and previous is not None and pairs[previous][0].facts is not None:
            pairs[previous] = (pairs[previous][0], record.outcome)
            continue
        last[record.incident] = len(pairs)
        pairs.append((record, record.outcome))
    return pairs


@dataclass(frozen=True, slots=True)
class _Ruled:
    """An incident's latest decision on kept facts: those facts, and what the engine made of them."""

    key: str  # the facts' JSON without `now`
    now: datetime
    newest_fault: datetime | None  # the incident's newest event other than a diagnostic's result
    fleet_size: int | None
    switch_size: tuple[str, int] | None
    ruling: Ruling
    placement: groups.Placement  # the node's group and mode under the new policy

    def holds_for(self, key: str, now: datetime) -> bool:
        """Whether a later decision of the incident, on facts `key` at `now`, decides the same.

        Triage records its first answer and decide the final one moments later, mostly on the same
        evidence. The engine ends its windows at the newest fault evidence, not at `now`
        (medic/policy/engine.py), so while both moments come after that evidence the same facts
        decide the same: the engine runs once for both, which halves a replay's time."""
        return key == self.key and self.newest_fault is not None and self.newest_fault <= min(self.now, now)


def _cut_now(text: str) -> tuple[str, datetime]:
    """Kept facts as JSON without their `now`, and `now`: what two decisions on the same evidence differ in."""
    key = text.index('"now": ')  # the key: only keys precede a colon, and a string's quotes are escaped
    start = text.index('"', key + len('"now": ')) + 1
    end = text.index('"', start)
    return text[:key] + text[end + 1 :], datetime.fromisoformat(text[start:end])


class _Decider:
    """Each recorded decision made again by `decide`, on its kept facts (or facts rebuilt), with the
    stored events as the context its cross-node conditions read."""

    def __init__(self, history: History, loaded: LoadedPolicy) -> None:
        self.history, self.loaded = history, loaded
        self.events = {e.id: e for e in history.events}
        # Only cross-node conditions read the context, each only events of its kinds: the others
        # would be indexed for nothing.
        kinds = loaded.policy.context_kinds()
        self.context = Context(e for e in history.events if e.kind in kinds)
        # The engine reads switch sizes from the context: each decision's recorded size is set in this
        # one mapping before it is decided, so every decision shares one index of the cluster's events.
        self.switch_sizes: dict[str, int] = {}
        self.context.switch_sizes = self.switch_sizes
        self.ruled: dict[str, _Ruled] = {}  # per incident
        self.rebuilt = 0
        self.lookback = loaded.policy.lookback()
        self.read: tuple[datetime, datetime] | None = None  # the stretch windowed conditions may read
        self.sizes_recorded = self.sizes_missing = False

    def decide(self, record: RecordedDecision) -> tuple[Ruling, int | None, groups.Placement] | None:
        """The decision made again, the fleet size its guardrails see and the node's placement; None
        when its events are no longer in the store."""
        if record.facts is None:
            facts = _rebuilt(record, self.history, self.context)
            if facts is None:
                return None
            self.rebuilt += 1
            self.sizes_missing |= facts.switch is not None
            self._reads(facts)
            placement = self._placed(facts, record.scope)
            # No fleet size was recorded: only the count limits apply, as in `medic triage`.
            return self._ruling(facts, placement), None, placement
        key, now = _cut_now(record.facts)
        prior = self.ruled.get(record.incident)
        if prior is None or not prior.holds_for(key, now):
            prior = self._rule(record.facts, key, now, record.scope)
            if prior is None:
                return None
            self.ruled[record.incident] = prior
        if prior.switch_size is not None:
            self.switch_sizes[prior.switch_size[0]] = prior.switch_size[1]
        return prior.ruling, prior.fleet_size, prior.placement

    def _placed(self, facts: Facts, scope: Scope) -> groups.Placement:
        """The incident's group and mode, on its nodes' names: the store keeps no scheduler facts."""
        return groups.place_all(
            self.loaded.policy, list(facts.nodes) if scope == "switch" else [facts.node], ()
        )

    def _ruling(self, facts: Facts, placement: groups.Placement) -> Ruling:
        """Decided with the group's rules besides the policy's, as the live path decides."""
        return ruling(groups.policy_for(self.loaded.policy, placement.group), facts)

    def _rule(self, text: str, key: str, now: datetime, scope: Scope) -> _Ruled | None:
        """Decide on kept facts; None when their events are no longer in the store."""
        kept = FactsRecord.model_validate_json(text)
        try:
            facts = facts_from(kept, self.events, self.context)
        except KeyError:  # one of its events is no longer in the store
            return None
        if facts.switch and kept.switch_size:
            # The context's: the engine reads the size there.
            self.switch_sizes[facts.switch] = kept.switch_size
            self.sizes_recorded = True
        else:
            self.sizes_missing |= facts.switch is not None
        faults = [e.time for e in facts.events if e.kind is not EventKind.DIAGNOSTIC]
        self._reads(facts)
        placement = self._placed(facts, scope)
        return _Ruled(
            key=key,
            now=now,
            newest_fault=max(faults, default=None),
            fleet_size=kept.fleet_size,
            switch_size=(facts.switch, kept.switch_size) if facts.switch and kept.switch_size else None,
            ruling=self._ruling(facts, placement),
            placement=placement,
        )

    def _reads(self, facts: Facts) -> None:
        start, end = window(facts, self.lookback)
        self.read = (min(start, self.read[0]), max(end, self.read[1])) if self.read else (start, end)


@dataclass(frozen=True, slots=True)
class ChangeLimit:
    """`--max-changed`: at most this many changed incidents, or this share of them (in percent)."""

    value: float
    percent: bool

    @classmethod
    def parse(cls, text: str) -> ChangeLimit:
        number = text.strip().removesuffix("%")
        try:
            value = float(number) if text.strip().endswith("%") else int(number)
        except ValueError:
            raise ValueError(f"{text!r}: give a number of incidents (5) or a percentage (2%)") from None
        if value < 0:
            raise ValueError(f"{text!r}: a limit cannot be negative")
        return cls(value, text.strip().endswith("%"))

    def __str__(self) -> str:
        return f"{self.value:g}%" if self.percent else f"{self.value:g}"

    def exceeded_by(self, report: ReplayReport) -> str | None:
        """Why the report goes over this limit, or None."""
        if self.percent:
            if report.changed_percent > self.value:
                return f"{report.changed_percent:.1f}% of incidents changed (limit {self})"
            return None
        if report.changed > self.value:
            return f"{report.changed} incidents changed (limit {self})"
        return None
