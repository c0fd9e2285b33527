"""`medic policy replay`: decide every recorded incident again with another policy, and compare.

Pure, like the engine: recorded decisions and stored events in, a report out. Each recorded
decision is made again by `decide` on the facts recorded with it (`FactsRecord`, kept in the
decision's row), then the new policy's guardrails are replayed in time order over the new
decisions, as `medic triage` replays them: the fleet is what the replayed decisions would have
left; the fleet size is the one recorded with each decision; an opened breaker stays open until
the time a human closed the real one. A decision recorded before facts were kept has its facts
rebuilt from the incident's stored events and the node's history, the way the flows build them,
and the report counts those.

The JSON form of `ReplayReport` is a public contract (docs/policy.md#replay); tests pin it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict, field_serializer

from medic.context import Context
from medic.dcgm_errors import Severity
from medic.events import EventKind, FaultEvent
from medic.facts import DiagnosticFact, Facts, facts_of, taken_out_by_us
from medic.incidents import Incident, Scope
from medic.policy import LoadedPolicy, decide, guardrails
from medic.policy.guardrails import FleetState, takes_node_out
from medic.policy.model import Action, Decision
from medic.triage import _ReplayedFleet

SCHEMA_VERSION = 1
# Facts fields kept as they are; `events` is kept as the events' ids and `context` (the cluster's
# recent events) is rebuilt from the store, which holds every event for good.
_NOT_KEPT = frozenset({"events", "context"})


class FactsRecord(BaseModel):
    """What the engine saw for one decision, as the `decisions.facts` column holds it."""

    model_config = ConfigDict(frozen=True)

    version: int = 1
    event_ids: tuple[str, ...]  # the incident's events at the time, oldest first
    fleet_size: int | None = None  # the guardrails' percentages were of this many nodes
    switch_size: int | None = None  # nodes under the incident's switch, for `fraction_at_least`
    incident: str
    node: str
    nodes: tuple[str, ...]
    jobs: tuple[str, ...]
    gpus: tuple[int, ...]
    event_count: int
    kinds: frozenset[EventKind]
    xid_codes: frozenset[int]
    dcgm_errors: frozenset[str]
    dcgm_severities: frozenset[Severity]
    ecc_dbe: int
    ecc_sbe: int
    straggler_reports: int
    straggler_max_ratio: float
    diagnostics: tuple[DiagnosticFact, ...]
    out_of_service: bool
    recent_remediations: int
    switch: str | None
    dcgm_categories: frozenset[str]
    now: datetime
    xid_resolutions: frozenset[str] = frozenset()
    recovery_actions: frozenset[str] = frozenset()
    row_remap: frozenset[str] = frozenset()
    nvlink_errors: int = 0
    sxids: frozenset[int] = frozenset()
    sxid_severities: frozenset[str] = frozenset()

    @field_serializer(
        "kinds",
        "xid_codes",
        "dcgm_errors",
        "dcgm_severities",
        "dcgm_categories",
        "xid_resolutions",
        "recovery_actions",
        "row_remap",
        "sxids",
        "sxid_severities",
    )
    def _sorted(self, values: frozenset[str] | frozenset[int]) -> list[str] | list[int]:
        # A set has no order; sorted, the same facts are always the same JSON.
        return sorted(values)  # type: ignore[return-value]  # str or int, never mixed


_KEPT = tuple(f.name for f in dataclasses.fields(Facts) if f.name not in _NOT_KEPT)


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


def facts_from(record: FactsRecord, events: Mapping[str, FaultEvent], context: Context) -> Facts:
    """The Facts a decision was made on, its events looked up among the stored ones."""
    return Facts(
        events=tuple(events[i] for i in record.event_ids),
        context=context,
        **{name: getattr(record, name) for name in _KEPT},
    )


@dataclass(frozen=True, slots=True)
class RecordedDecision:
    """One row of the decisions table, with what replaying it needs from its incident."""

    incident: str
    node: str  # the switch's name for a switch-wide incident
    scope: Scope
    decided_at: datetime
    decision: Decision  # as recorded: rule, action, level, guardrail
    facts: str | None  # a FactsRecord as JSON; None when recorded before facts were kept
    flow_run_id: str | None = None


@dataclass(frozen=True, slots=True)
class History:
    """What the store holds for a replay (medic/store/replay.py)."""

    decisions: Sequence[RecordedDecision]  # in the order they were made
    events: Sequence[FaultEvent]  # the decisions' incidents' events and the cluster's around them
    incident_events: Mapping[str, Sequence[FaultEvent]]  # per incident, oldest first (to rebuild facts)
    remediations: Mapping[str, Sequence[FaultEvent]]  # per node, oldest first (to rebuild facts)
    breaker_closed_at: Sequence[datetime] = ()  # when humans closed the real breaker


class Outcome(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rule: str
    action: Action
    diagnose_level: int | None = None
    guardrail: str | None = None


class Count(BaseModel):
    model_config = ConfigDict(extra="forbid")

    before: int = 0
    after: int = 0


class ChangedIncident(BaseModel):
    model_config = ConfigDict(extra="forbid")

    incident: str
    node: str
    decided_at: datetime  # the incident's last decision
    before: Outcome  # its last decision as recorded
    after: Outcome  # the same decision made by the new policy
    steps_before: list[str]  # every decision of the incident, oldest first: `diagnose 2`, `reboot`
    steps_after: list[str]
    command: str  # shows the incident's record: `medic incident ID`
    flow_run_id: str | None
    flow_run_url: str | None = None  # its run in the Prefect UI, where the UI's address is known


class NodeChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node: str
    taken_out_before: int  # decisions that took the node out of service
    taken_out_after: int


class Trip(BaseModel):
    model_config = ConfigDict(extra="forbid")

    incident: str
    node: str
    decided_at: datetime
    guardrail: str
    blocked_action: Action
    recorded: bool  # the recorded decision was stopped by the same guardrail
    reason: str


class ReplayReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    policy: str
    policy_sha256: str
    since: datetime | None
    incidents: int
    decisions: int
    rebuilt: int  # decisions recorded without facts: facts rebuilt from the stored events
    skipped: int  # decisions whose events are no longer in the store: not replayed
    changed: int  # incidents with a different sequence of actions
    actions: dict[str, Count]  # by action, over each incident's last decision
    rules: dict[str, Count]  # by winning rule, over each incident's last decision
    changes: list[ChangedIncident]
    nodes: list[NodeChange]  # only the nodes taken out a different number of times
    guardrails: list[Trip]  # every replayed decision a guardrail stopped
    exceeded: list[str] = []  # the limits given (`--max-changed`) that the changes go over

    @property
    def changed_percent(self) -> float:
        return 100 * self.changed / self.incidents if self.incidents else 0.0


@dataclass(frozen=True, slots=True)
class _Step:
    record: RecordedDecision
    before: Decision
    after: Decision
    last: bool  # the incident's last decision

    def acted(self, decision: Decision) -> bool:
        """Whether the flow acted on this decision: the incident's last one, or a diagnostic the ladder
        runs. Triage's first answer is recorded too, but the final decision is what is done."""
        return self.last or decision.action is Action.DIAGNOSE


def _step_label(decision: Decision) -> str:
    if decision.action is Action.DIAGNOSE and decision.diagnose_level is not None:
        return f"diagnose {decision.diagnose_level}"
    return decision.action.value


def _steps(decisions: Iterable[Decision]) -> list[str]:
    """An incident's decisions as labels, a decision repeated at the next stage (triage's first
    answer, then the same final decision) once."""
    labels: list[str] = []
    for decision in decisions:
        label = _step_label(decision)
        if not labels or labels[-1] != label:
            labels.append(label)
    return labels


def _outcome(decision: Decision) -> Outcome:
    return Outcome(
        rule=decision.rule,
        action=decision.action,
        diagnose_level=decision.diagnose_level,
        guardrail=decision.guardrail,
    )


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


def _recorded_outcomes(records: Sequence[RecordedDecision]) -> list[tuple[RecordedDecision, Decision]]:
    """Each decision to replay with the outcome that was recorded for it. A row without facts right
    after one of the same incident with facts is that decision stopped at the last check before its
    action (a guardrail under the slot): it is the earlier decision's recorded outcome, not a new one."""
    pairs: list[tuple[RecordedDecision, Decision]] = []
    last: dict[str, int] = {}
    for record in records:
        previous = last.get(record.incident)
        if record.facts is None and previous is not None and pairs[previous][0].facts is not None:
            pairs[previous] = (pairs[previous][0], record.decision)
            continue
        last[record.incident] = len(pairs)
        pairs.append((record, record.decision))
    return pairs


@dataclass(frozen=True, slots=True)
class _Ruled:
    """An incident's latest decision on kept facts: those facts, and what the engine made of them."""

    key: str  # the facts' JSON without `now`
    now: datetime
    newest_fault: datetime | None  # the incident's newest event other than a diagnostic's result
    fleet_size: int | None
    switch_size: tuple[str, int] | None
    decision: Decision

    def holds_for(self, key: str, now: datetime) -> bool:
        """Whether a later decision of the incident, on facts `key` at `now`, decides the same.

        Triage records its first answer and decide the final one moments later, mostly on the same
        evidence. The engine ends its windows at the newest fault evidence, not at `now`
        (medic/policy/engine.py), so while both moments come after that evidence the same facts
        decide the same: the engine runs once for both, which halves a replay's time."""
        return key == self.key and self.newest_fault is not None and self.newest_fault <= min(self.now, now)


def _cut_now(text: str) -> tuple[str, datetime]:
    """Kept facts as JSON without their `now`, and `now`: what two decisions on the same evidence differ in."""
    key = text.index('"now"')
    start = text.index('"', key + len('"now"')) + 1
    end = text.index('"', start)
    return text[:key] + text[end + 1 :], datetime.fromisoformat(text[start:end])


def _rule(
    text: str,
    key: str,
    now: datetime,
    loaded: LoadedPolicy,
    events: Mapping[str, FaultEvent],
    context: Context,
    switch_sizes: dict[str, int],
) -> _Ruled | None:
    """Decide on kept facts; None when their events are no longer in the store."""
    kept = FactsRecord.model_validate_json(text)
    if not all(i in events for i in kept.event_ids):
        return None
    if kept.switch and kept.switch_size:
        switch_sizes[kept.switch] = kept.switch_size  # the context's: the engine reads the size there
    faults = [events[i].time for i in kept.event_ids if events[i].kind is not EventKind.DIAGNOSTIC]
    return _Ruled(
        key=key,
        now=now,
        newest_fault=max(faults, default=None),
        fleet_size=kept.fleet_size,
        switch_size=(kept.switch, kept.switch_size) if kept.switch and kept.switch_size else None,
        decision=decide(loaded.policy, facts_from(kept, events, context), loaded.sha256),
    )


def replay(history: History, loaded: LoadedPolicy, since: datetime | None = None) -> ReplayReport:
    """Decide each recorded decision again with `loaded`, in the order they were made, and compare."""
    policy = loaded.policy
    by_id = {e.id: e for e in history.events}
    for events in history.incident_events.values():
        by_id.update((e.id, e) for e in events)
    context = Context(by_id.values())
    # The engine reads switch sizes from the context: each decision's recorded size is set in this
    # one mapping before it is decided, so every decision shares one index of the cluster's events.
    switch_sizes: dict[str, int] = {}
    context.switch_sizes = switch_sizes
    fleet = _ReplayedFleet(None)
    breaker = policy.guardrails.circuit_breaker
    breaker_window = timedelta(minutes=breaker.window_minutes if breaker else 0)
    taken_out: deque[tuple[datetime, str]] = deque()  # (when, node), oldest first
    closings = sorted(history.breaker_closed_at)
    tripped_at: datetime | None = None
    steps: list[_Step] = []
    rebuilt = skipped = 0
    pairs = _recorded_outcomes(history.decisions)
    last_of = {record.incident: i for i, (record, _) in enumerate(pairs)}
    ruled_by_incident: dict[str, _Ruled] = {}
    for index, (record, before) in enumerate(pairs):
        now = record.decided_at
        ruled: Decision | None = None
        if record.facts is None:
            facts = _rebuilt(record, history, context)
            rebuilt += facts is not None
            fleet.fleet_size = None  # not recorded: only the count limits apply, as in `medic triage`
            ruled = decide(policy, facts, loaded.sha256) if facts is not None else None
        else:
            key, seen_at = _cut_now(record.facts)
            prior = ruled_by_incident.get(record.incident)
            if prior is None or not prior.holds_for(key, seen_at):
                prior = _rule(record.facts, key, seen_at, loaded, by_id, context, switch_sizes)
            if prior is not None:
                ruled_by_incident[record.incident] = prior
                fleet.fleet_size = prior.fleet_size
                if prior.switch_size is not None:
                    switch_sizes[prior.switch_size[0]] = prior.switch_size[1]
                ruled = prior.decision
        if ruled is None:
            skipped += 1
            continue
        # Only the breaker reads when nodes went out, and only within its window: dropping the older
        # ones as the replay goes keeps each decision's check short over weeks of decisions.
        while taken_out and taken_out[0][0] < now - breaker_window:
            went, node = taken_out.popleft()
            if fleet.taken_out_at.get(node) == went:
                del fleet.taken_out_at[node]
        if fleet.breaker_open and any(tripped_at is not None and tripped_at < c <= now for c in closings):
            fleet.breaker_open = False  # a human closed the real breaker since the replayed one opened
        # Only a decision that takes a node out meets a fleet limit (docs/policy.md#guardrails): the
        # fleet's snapshot, a copy of every node out of service, is taken for those alone.
        state = fleet.state(now, now) if takes_node_out(ruled) else FleetState(now)
        after = guardrails.apply(policy.guardrails, state, record.node, ruled, record.scope)
        if after.guardrail == "circuit_breaker" and not fleet.breaker_open:
            tripped_at, fleet.breaker_open = now, True  # opened by any decision, as the flows open it
        step = _Step(record, before, after, last_of[record.incident] == index)
        if step.acted(after):
            fleet.record(record.node, now, after)
            if takes_node_out(after):
                taken_out.append((now, record.node))
        steps.append(step)
    return _report(steps, loaded, since, rebuilt, skipped)


def _report(
    steps: Iterable[_Step], loaded: LoadedPolicy, since: datetime | None, rebuilt: int, skipped: int
) -> ReplayReport:
    by_incident: dict[str, list[_Step]] = defaultdict(list)
    taken_before: Counter[str] = Counter()
    taken_after: Counter[str] = Counter()
    trips: list[Trip] = []
    decisions = 0
    for step in steps:
        decisions += 1
        by_incident[step.record.incident].append(step)
        node = step.record.node
        taken_before[node] += step.acted(step.before) and takes_node_out(step.before)
        taken_after[node] += step.acted(step.after) and takes_node_out(step.after)
        after = step.after
        if after.guardrail is not None and after.blocked_action is not None:
            trips.append(
                Trip(
                    incident=step.record.incident,
                    node=node,
                    decided_at=step.record.decided_at,
                    guardrail=after.guardrail,
                    blocked_action=after.blocked_action,
                    recorded=step.before.guardrail == after.guardrail,
                    reason=after.reason.rpartition(f"stopped by guardrail {after.guardrail}: ")[2],
                )
            )
    tally: dict[str, Counter[str]] = {"actions before": Counter(), "actions after": Counter()}
    tally |= {"rules before": Counter(), "rules after": Counter()}
    changes: list[ChangedIncident] = []
    for incident, its in by_incident.items():
        last = its[-1]
        tally["actions before"][last.before.action.value] += 1
        tally["actions after"][last.after.action.value] += 1
        tally["rules before"][last.before.rule] += 1
        tally["rules after"][last.after.rule] += 1
        steps_before = _steps(s.before for s in its)
        steps_after = _steps(s.after for s in its)
        if steps_before != steps_after:
            changes.append(
                ChangedIncident(
                    incident=incident,
                    node=last.record.node,
                    decided_at=last.record.decided_at,
                    before=_outcome(last.before),
                    after=_outcome(last.after),
                    steps_before=steps_before,
                    steps_after=steps_after,
                    command=f"medic incident {incident}",
                    flow_run_id=last.record.flow_run_id,
                )
            )
    nodes = [
        NodeChange(node=n, taken_out_before=taken_before[n], taken_out_after=taken_after[n])
        for n in sorted(taken_before.keys() | taken_after.keys())
        if taken_before[n] != taken_after[n]
    ]
    nodes.sort(key=lambda c: -abs(c.taken_out_after - c.taken_out_before))
    return ReplayReport(
        policy=loaded.path,
        policy_sha256=loaded.sha256,
        since=since,
        incidents=len(by_incident),
        decisions=decisions,
        rebuilt=rebuilt,
        skipped=skipped,
        changed=len(changes),
        actions=_counts(tally["actions before"], tally["actions after"]),
        rules=_counts(tally["rules before"], tally["rules after"]),
        changes=changes,
        nodes=nodes,
        guardrails=trips,
    )


def _counts(before: Counter[str], after: Counter[str]) -> dict[str, Count]:
    return {k: Count(before=before[k], after=after[k]) for k in sorted(before.keys() | after.keys())}


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
