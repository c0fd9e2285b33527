"""What `medic policy replay` reports, and the half of the replay that makes it: the new policy's
guardrails replayed in time order over the decisions made again (medic/whatif/replay.py), as
`medic triage` replays them, then every incident's story compared with the recorded one.

Each incident is judged in its node's group and mode under the new policy (medic/whatif/replay.py
places it): a group's own limits hold over its own nodes, and a node action in observe mode is what
would have been done, never carried out: it takes no node out and opens no breaker. The report
breaks the incidents down by group.

The JSON form of `ReplayReport` is a public contract (docs/policy.md#replay); tests pin it.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from operator import itemgetter
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

from medic.incidents import Scope
from medic.policy import LoadedPolicy, Mode, guardrails
from medic.policy.guardrails import UNGUARDED, Acting, FleetState, takes_node_out
from medic.policy.model import Action, Policy
from medic.policy.selectors import OTHER_NODES
from medic.triage.fleet import ReplayedFleet
from medic.triage.limits import GroupLimits

# The row of the incidents whose node's group cannot be told from its name (no group is named so:
# group names start with a letter or digit).
UNDECIDABLE = "?"

SCHEMA_VERSION = 1


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
    group: str = OTHER_NODES  # its row in `ReplayReport.groups`: the node's group under the new policy
    mode: Mode = Mode.REMEDIATE  # the node's mode under the new policy: observe only says `after`


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


class GroupResult(BaseModel):
    """The incidents of one node group, as the new policy places their nodes, each by its last
    decision: a node action carried out (`acted`) or, in observe mode, only said (`would_have`)."""

    model_config = ConfigDict(extra="forbid")

    group: str  # a group's name; `*`: the nodes no group takes; `?`: those whose group cannot be told
    mode: Mode  # the group's mode in the new policy (`?`: observe, nothing done)
    incidents: int
    changed: int
    acted: Count  # before: as recorded (in the mode recorded); after: the new policy's
    would_have: Count


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
    groups: list[GroupResult] = []  # the policy's groups in order, then `*`, then `?` when any

    @property
    def changed_percent(self) -> float:
        return 100 * self.changed / self.incidents if self.incidents else 0.0


class Redecided(NamedTuple):
    """A recorded decision made again by the new policy, before its guardrails. A tuple of plain values
    and shared outcomes: a process deciding part of a replay hands its decisions over in one piece."""

    decided_at: datetime
    id: int  # the decision's row: of two made at one moment, the one recorded first came first
    incident: str
    node: str  # the switch's name for a switch-wide incident
    scope: Scope
    before: Outcome  # as recorded
    after: Outcome  # as the new policy decides, before its guardrails
    fleet_size: int | None  # the guardrails' percentages are of this many nodes
    last: bool  # the incident's last decision
    flow_run_id: str | None
    observed_before: bool = False  # recorded in observe mode: said, not done
    group: str | None = None  # the node's group under the new policy
    mode: Mode = Mode.REMEDIATE  # and its mode
    undecidable: bool = False  # its group cannot be told from its name: escalated, nothing done


@dataclass(frozen=True, slots=True)
class Redecisions:
    """Recorded decisions made again (medic.whatif.replay.redecide), in the order they were made, and
    what they read beyond their own incidents (medic.whatif.replay.decided_as_one)."""

    decisions: Sequence[Redecided]
    rebuilt: int  # decisions recorded without facts: facts rebuilt from the stored events
    skipped: int  # decisions whose events are no longer in the store: not decided again
    held: tuple[datetime, datetime] | None = None  # the stretch of the cluster's events the history held
    read: tuple[datetime, datetime] | None = None  # the stretch their windowed conditions may have read
    earliest: datetime | None = None  # their incidents' earliest event
    switch_sizes_recorded: bool = False  # some decision recorded the size of its switch
    switch_sizes_missing: bool = False  # some decision under a switch recorded no size for it


def judge(
    parts: Sequence[Redecisions], loaded: LoadedPolicy, closed_at: Iterable[datetime], since: datetime | None
) -> ReplayReport:
    """Replay the new policy's guardrails over the decisions made again, all parts together in the
    order the decisions were made, and compare each incident with what was recorded."""
    judging = Judge(loaded, closed_at)
    judging.take(heapq.merge(*(part.decisions for part in parts)))
    return judging.report(parts, since)


class Judge:
    """The new policy's guardrails replayed over decisions made again, taken in the order they were
    made, each incident compared with its record as soon as its last decision is judged.

    Taken a stretch at a time, so that one process judges the earlier decisions while another still
    decides the later ones (medic/apps/cli/replay_parallel.py)."""

    def __init__(self, loaded: LoadedPolicy, closed_at: Iterable[datetime]) -> None:
        self.loaded = loaded
        self.fleet = _Fleet(loaded.policy, closed_at)
        self.trips: list[Trip] = []
        self.decisions = 0
        # Incidents whose last decision is still to come: the order each first came, its decisions with
        # their outcomes before and after (guardrails included).
        self.open: dict[str, tuple[int, list[tuple[Redecided, _Traits, _Traits]]]] = {}
        self.known: dict[int, _Traits] = {}  # by the id of the outcome
        self.incidents = 0
        self.changes: list[tuple[int, ChangedIncident]] = []
        self.actions: tuple[Counter[str], Counter[str]] = (Counter(), Counter())  # before, after
        self.rules: tuple[Counter[str], Counter[str]] = (Counter(), Counter())
        self.taken_out: tuple[Counter[str], Counter[str]] = (Counter(), Counter())
        # Per group row (`*`, `?` included): incidents, changed, and node actions acted on or only said.
        self.by_group: dict[str, Counter[str]] = {}

    def take(self, decisions: Iterable[Redecided]) -> None:
        """Judge these decisions, made after every one taken so far, in the order they were made."""
        fleet, open_, (taken_before, taken_after) = self.fleet, self.open, self.taken_out
        known, learn = self.known, self._learn
        for decided in decisions:
            after, stopped = fleet.apply(decided, known.get(id(decided.after)) or learn(decided.after))
            if stopped is not None:
                self.trips.append(_trip(decided, *stopped))
            its = open_.get(decided.incident)
            if its is None:
                its = open_[decided.incident] = (self.incidents, [])
                self.incidents += 1
            before = known.get(id(decided.before)) or learn(decided.before)
            its[1].append((decided, before, after))
            # The flow acts on an incident's last decision, and on a diagnostic the ladder runs; triage's
            # first answer is recorded too, but the final decision is what is done.
            # A node action in observe mode was (or would be) said, not done: it takes no node out.
            if before.takes_out and (decided.last or before.diagnose) and not decided.observed_before:
                taken_before[decided.node] += 1
            if after.takes_out and (decided.last or after.diagnose) and decided.mode is not Mode.OBSERVE:
                taken_after[decided.node] += 1
            if decided.last:
                self._close(decided.incident)
            self.decisions += 1

    def _learn(self, outcome: Outcome) -> _Traits:
        traits = self.known[id(outcome)] = _Traits.of(outcome)
        return traits

    def report(self, parts: Sequence[Redecisions], since: datetime | None) -> ReplayReport:
        """The report on every decision taken, those of `parts` (which count what they rebuilt and
        skipped)."""
        for incident in list(self.open):  # whose last decision was skipped: its events are gone
            self._close(incident)
        before, after = self.taken_out
        nodes = [
            NodeChange(node=n, taken_out_before=before[n], taken_out_after=after[n])
            for n in sorted(before.keys() | after.keys())
            if before[n] != after[n]
        ]
        nodes.sort(key=lambda c: -abs(c.taken_out_after - c.taken_out_before))
        self.changes.sort(key=itemgetter(0))
        return ReplayReport(
            policy=self.loaded.path,
            policy_sha256=self.loaded.sha256,
            since=since,
            incidents=self.incidents,
            decisions=self.decisions,
            rebuilt=sum(part.rebuilt for part in parts),
            skipped=sum(part.skipped for part in parts),
            changed=len(self.changes),
            actions=_counts(*self.actions),
            rules=_counts(*self.rules),
            changes=[change for _, change in self.changes],
            nodes=nodes,
            guardrails=self.trips,
            groups=self._groups(),
        )

    def _groups(self) -> list[GroupResult]:
        policy = self.loaded.policy
        modes = {g.name: g.mode for g in policy.groups} | {
            OTHER_NODES: policy.mode,
            UNDECIDABLE: Mode.OBSERVE,
        }
        shown = [g.name for g in policy.groups] + [OTHER_NODES]
        shown += [UNDECIDABLE] if UNDECIDABLE in self.by_group else []
        rows = []
        for name in shown:
            counts = self.by_group.get(name, Counter())
            rows.append(
                GroupResult(
                    group=name,
                    mode=modes[name],
                    incidents=counts["incidents"],
                    changed=counts["changed"],
                    acted=Count(before=counts["acted_before"], after=counts["acted_after"]),
                    would_have=Count(before=counts["said_before"], after=counts["said_after"]),
                )
            )
        return rows

    def _close(self, incident: str) -> None:
        """Count an incident whose decisions have all been judged, and compare it with its record."""
        order, its = self.open.pop(incident)
        final, before, after = its[-1]
        self.actions[0][before.action] += 1
        self.actions[1][after.action] += 1
        self.rules[0][before.outcome.rule] += 1
        self.rules[1][after.outcome.rule] += 1
        row = UNDECIDABLE if final.undecidable else final.group or OTHER_NODES
        counts = self.by_group.get(row)
        if counts is None:
            counts = self.by_group[row] = Counter()
        counts["incidents"] += 1
        if before.outcome.action not in UNGUARDED:
            counts["said_before" if final.observed_before else "acted_before"] += 1
        if after.outcome.action not in UNGUARDED:
            counts["said_after" if final.mode is Mode.OBSERVE else "acted_after"] += 1
        if all(b.label == a.label for _, b, a in its):
            return  # the same steps, as most incidents' are
        steps_before = _steps(b.label for _, b, _ in its)
        steps_after = _steps(a.label for _, _, a in its)
        if steps_before != steps_after:
            change = ChangedIncident(
                incident=incident,
                node=final.node,
                decided_at=final.decided_at,
                before=before.outcome,
                after=after.outcome,
                steps_before=steps_before,
                steps_after=steps_after,
                command=f"medic incident {incident}",
                flow_run_id=final.flow_run_id,
                group=row,
                mode=final.mode,
            )
            self.changes.append((order, change))
            counts["changed"] += 1


class _Traits(NamedTuple):
    """What judging asks of an outcome, worked out once per outcome object: a replay's decisions share
    a few dozen outcomes (medic/whatif/replay.py), and asking each decision's again cost a fifth of
    judging."""

    outcome: Outcome  # held, so that no other outcome is given its id while it is known
    action: str
    label: str  # as an incident's steps show it
    takes_out: bool
    diagnose: bool

    @classmethod
    def of(cls, outcome: Outcome) -> _Traits:
        return cls(
            outcome,
            outcome.action.value,
            _step_label(outcome),
            takes_node_out(outcome),
            outcome.action is Action.DIAGNOSE,
        )


def _trip(decided: Redecided, guardrail: str, why: str) -> Trip:
    return Trip(
        incident=decided.incident,
        node=decided.node,
        decided_at=decided.decided_at,
        guardrail=guardrail,
        blocked_action=decided.after.action,
        recorded=decided.before.guardrail == guardrail,
        reason=why,
    )


class _Fleet:
    """The fleet as the new decisions would have left it: a node taken out stays out until a later
    decision returns it; a breaker the replay opens stays open until a human closed the real one."""

    def __init__(self, policy: Policy, closed_at: Iterable[datetime]) -> None:
        self.guardrails = policy.guardrails
        self.fleet = ReplayedFleet(None)
        self.limits = GroupLimits(policy)
        breaker = self.guardrails.circuit_breaker
        self.breaker_window = timedelta(minutes=breaker.window_minutes if breaker else 0)
        self.taken_out: deque[tuple[datetime, str]] = deque()  # (when, node), oldest first
        self.closings = sorted(closed_at)
        self.tripped_at: datetime | None = None
        self.escalated: dict[tuple[str, str | None], _Traits] = {}

    def apply(self, decided: Redecided, traits: _Traits) -> tuple[_Traits, tuple[str, str] | None]:
        """The new decision as its guardrails and its node's mode let it be, and the guardrail that
        stopped it with why."""
        decision = decided.after
        if decided.undecidable:
            return self._escalated(decision.rule, None), None  # left alone, handed to people (in_mode)
        if decision.action in UNGUARDED:
            return traits, None  # nothing stops it, and the fleet stays as it is (half of all decisions)
        now, fleet = decided.decided_at, self.fleet
        fleet.fleet_size = decided.fleet_size
        # Only the breaker reads when nodes went out, and only within its window: dropping the older
        # ones as the replay goes keeps each decision's check short over weeks of decisions.
        while self.taken_out and self.taken_out[0][0] < now - self.breaker_window:
            went, node = self.taken_out.popleft()
            if fleet.taken_out_at.get(node) == went:
                del fleet.taken_out_at[node]
        tripped_at = self.tripped_at
        if fleet.breaker_open and any(
            tripped_at is not None and tripped_at < c <= now for c in self.closings
        ):
            fleet.breaker_open = False  # a human closed the real breaker since the replayed one opened
        # Only a decision that takes a node out meets a fleet limit (docs/policy.md#guardrails): the
        # fleet's snapshot is taken for those alone.
        state = fleet.state(now, now) if traits.takes_out else FleetState(now)
        stopped = guardrails.check(
            self.guardrails, state, decided.node, decision, decided.scope
        ) or self.limits.check(decided.group, now, now, decided.node, decision, decided.scope)
        after = traits
        acting = decided.mode is not Mode.OBSERVE  # observe: said, never done, and opens no breaker
        if stopped is not None:  # escalated instead, as `guardrails.apply` turns a stopped decision
            after = self._escalated(decision.rule, stopped[0])
            if stopped[0] == "circuit_breaker" and not fleet.breaker_open and acting:
                # Opened by any decision acted on, as the flows open it.
                self.tripped_at, fleet.breaker_open = now, True
        if acting and (decided.last or after.diagnose):  # acted on (Judge.take)
            fleet.record(decided.node, now, after.outcome)
            self.limits.record(decided.group, decided.node, now, after.outcome)
            if after.takes_out:
                self.taken_out.append((now, decided.node))
        return after, stopped

    def _escalated(self, rule: str, guardrail: str | None) -> _Traits:
        """The outcome of `rule`'s decision stopped by `guardrail` (None: by its node's undecidable
        group): one for each pair."""
        found = self.escalated.get((rule, guardrail))
        if found is None:
            outcome = Outcome(rule=rule, action=Action.ESCALATE, guardrail=guardrail)
            found = self.escalated[rule, guardrail] = _Traits.of(outcome)
        return found


def _step_label(decision: Acting) -> str:
    if decision.action is Action.DIAGNOSE and decision.diagnose_level is not None:
        return f"diagnose {decision.diagnose_level}"
    return decision.action.value


def _steps(labels: Iterable[str]) -> list[str]:
    """An incident's decisions as labels, a decision repeated at the next stage (triage's first
    answer, then the same final decision) once."""
    steps: list[str] = []
    for label in labels:
        if not steps or steps[-1] != label:
            steps.append(label)
    return steps


def _counts(before: Counter[str], after: Counter[str]) -> dict[str, Count]:
    return {k: Count(before=before[k], after=after[k]) for k in sorted(before.keys() | after.keys())}
