"""The rollout report (`medic rollout report`, docs/rollout.md#the-report): per node group, GPU Medic's
decisions beside what people did to the same nodes (`node_state` events, decision 0019).

Pure: built from plain records the store returns (medic/store/rollout.py). Its JSON is a public
contract: `schema_version` changes when a key is renamed or removed.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta

from pydantic import BaseModel

from medic.policy.groups import place, unknown_node
from medic.policy.model import Policy
from medic.policy.selectors import OTHER_NODES

SCHEMA_VERSION = 1

# The one mapping from GPU Medic's node actions to the `node_state` changes that are the same kind of
# action by people. A GPU reset leaves no trace in Slurm: a reboot is what people do instead. A replaced
# node is one people hold down or failed. `none` and `escalate` act on no node and are paired with nothing.
AGREES: Mapping[str, frozenset[str]] = {
    "diagnose": frozenset({"drain"}),
    "drain": frozenset({"drain"}),
    "reset_gpu": frozenset({"reboot_requested", "reboot"}),
    "reboot": frozenset({"reboot_requested", "reboot"}),
    "replace": frozenset({"fail", "down"}),
    "reintegrate": frozenset({"resume"}),
}
# The actions whose wrong call costs a node's work: a disagreement on one of them blocks readiness.
DESTRUCTIVE = frozenset({"reset_gpu", "reboot", "replace"})
# People's actions on a node. `not_responding` is the scheduler noticing a fault, and `resume` a return to
# service: neither is an action GPU Medic could have missed.
PEOPLE_ACTIONS = frozenset({"drain", "fail", "down", "reboot_requested", "reboot"})


@dataclass(frozen=True, slots=True)
class DecisionFact:
    """One decision of GPU Medic on one node (an incident of node scope)."""

    incident: str
    node: str
    at: datetime
    action: str
    mode: str | None  # None: recorded before modes existed, acted on as `remediate`
    group: str | None  # None: the policy's top-level mode
    rule: str


@dataclass(frozen=True, slots=True)
class PeopleChange:
    """One `node_state` event: a change of a node's state GPU Medic did not make."""

    id: str
    node: str
    at: datetime
    change: str


@dataclass(frozen=True, slots=True)
class Opened:
    """An incident opened on a node: the node failing (again)."""

    incident: str
    node: str
    at: datetime


@dataclass(frozen=True, slots=True)
class Thresholds:
    decisions: int = 50
    agreement: float = 0.95
    destructive_disagreements: int = 0


@dataclass(frozen=True, slots=True)
class Override:
    """Thresholds given on the command line: each one given wins over the policy's, for every group."""

    decisions: int | None = None
    agreement: float | None = None
    destructive_disagreements: int | None = None


NO_OVERRIDE = Override()


def policy_thresholds(policy: Policy, override: Override = NO_OVERRIDE) -> dict[str, Thresholds]:
    """Each group's readiness thresholds by name (`*`: the policy's own `readiness`, which a group's
    keys change for it), with the override's over them."""
    top = policy.readiness
    chosen = {OTHER_NODES: top}
    for g in policy.groups:
        given = g.readiness.model_dump(exclude_none=True) if g.readiness is not None else {}
        chosen[g.name] = top.model_copy(update=given)
    forced = {k: v for k, v in asdict(override).items() if v is not None}
    return {
        name: replace(Thresholds(t.min_decisions, t.min_agreement, t.max_destructive_disagreements), **forced)
        for name, t in chosen.items()
    }


@dataclass(frozen=True, slots=True)
class Placed:
    """The group a node with no decision of GPU Medic is reported in, and why not in one of the policy's
    groups when one may take it (None: placed, or certainly in none)."""

    group: str
    why: str | None = None


def in_no_group(node: str) -> Placed:
    """No policy given to place by: a node with no decision is reported with the nodes in no group."""
    return Placed(OTHER_NODES)


def placer(policy: Policy) -> Callable[[str], Placed]:
    """Places a node by the policy's group selectors on what the report knows of it: its name (the store
    keeps no partitions, features or GPUs of a node, nor do `node_state` events). A group that turns on
    such a fact cannot be told, and the node stays under `*` with the reason: never guessed in or out."""

    def at(node: str) -> Placed:
        found = place(policy, unknown_node(node))
        if found.problem is not None:
            return Placed(OTHER_NODES, f"{found.problem} (the report knows a node by its name only)")
        return Placed(found.group_name or OTHER_NODES)

    return at


class Pair(BaseModel):
    incident: str
    node: str
    decided_at: datetime
    action: str
    rule: str
    verdict: str  # agreed | disagreed | missed_by_people | false_alarm | pending
    people_change: str | None  # the change that agreed, else the first one in the window
    people_at: datetime | None
    saved_minutes: float | None  # agreed: people's time minus the decision's


class ModeCount(BaseModel):
    mode: str
    decisions: int
    first_at: datetime
    last_at: datetime


class Readiness(BaseModel):
    ready: bool
    agreement: float | None  # None: no decision judged yet
    reasons: list[str]  # why not; empty when ready


class Unplaced(BaseModel):
    """One of our misses reported under `*` because the policy's groups could not be told for its node."""

    event: str
    node: str
    why: str


class Group(BaseModel):
    name: str
    mode_now: str | None  # the last recorded mode (None: no record)
    modes: list[ModeCount]  # the decisions with a node action, by the mode they ran in
    would_have: int  # observe decisions with a node action
    agreed: int
    disagreed: int
    missed_by_people: int
    false_alarm: int
    pending: int  # no people action, and too recent to know whether the node fails again
    destructive_disagreements: int
    our_misses: int
    saved_minutes_median: float | None
    saved_minutes_total: float
    readiness: Readiness
    pairs: list[Pair]
    missed: list[str]  # the ids of people's changes GPU Medic saw nothing before
    thresholds: dict[str, float]  # the group's own readiness thresholds, as used
    unplaced: list[Unplaced]  # misses kept under `*` for want of a node fact a group turns on


class RolloutReport(BaseModel):
    schema_version: int = SCHEMA_VERSION
    generated_at: datetime
    since: datetime | None
    window_hours: float
    recurrence_days: float
    thresholds: dict[str, float]
    groups: list[Group]


@dataclass(frozen=True, slots=True)
class _Settings:
    window: timedelta
    recurrence: timedelta
    now: datetime


def build_rollout(
    decisions: Iterable[DecisionFact],
    people: Iterable[PeopleChange],
    opened: Iterable[Opened],
    *,
    modes_now: Mapping[str, str | None],
    since: datetime | None,
    now: datetime,
    window: timedelta = timedelta(hours=6),
    recurrence: timedelta = timedelta(days=7),
    thresholds: Thresholds = Thresholds(),
    group_thresholds: Mapping[str, Thresholds] | None = None,
    placed: Callable[[str], Placed] = in_no_group,
    group: str | None = None,
) -> RolloutReport:
    """Per group, each decision since `since` judged against people's changes in `window` after it.

    An incident counts once, by its first decision (a later one is the ladder stopping). Decisions and
    changes before `since` are read only as context: a change's preceding decision, a later failure.
    A group is judged against its own thresholds (`group_thresholds`), else `thresholds`. A miss on a
    node with no decision goes where `placed` puts the node.
    """
    settings = _Settings(window, recurrence, now)
    own = group_thresholds or {}
    calls = _first_per_incident(decisions)
    changes = sorted((c for c in people if c.change in PEOPLE_ACTIONS or c.change == "resume"), key=_at)
    by_node: defaultdict[str, list[PeopleChange]] = defaultdict(list)
    for c in changes:
        by_node[c.node].append(c)
    failures: defaultdict[str, list[Opened]] = defaultdict(list)
    for o in opened:
        failures[o.node].append(o)
    group_of_node = {d.node: d.group or OTHER_NODES for d in calls}

    in_report = [d for d in calls if since is None or d.at >= since]
    grouped: defaultdict[str, list[DecisionFact]] = defaultdict(list)
    for d in in_report:
        grouped[d.group or OTHER_NODES].append(d)
    misses = _our_misses(changes, calls, window, since)
    missed_by_group: defaultdict[str, list[str]] = defaultdict(list)
    unplaced: defaultdict[str, list[Unplaced]] = defaultdict(list)
    homes: dict[str, Placed] = {node: Placed(name) for node, name in group_of_node.items()}
    for c in misses:
        home = homes.get(c.node) or homes.setdefault(c.node, placed(c.node))
        missed_by_group[home.group].append(c.id)
        if home.why is not None:
            unplaced[home.group].append(Unplaced(event=c.id, node=c.node, why=home.why))

    names = sorted(set(grouped) | set(missed_by_group))
    if group is not None:
        names = [n for n in names if n == group] or [group]
    return RolloutReport(
        generated_at=now,
        since=since,
        window_hours=window.total_seconds() / 3600,
        recurrence_days=recurrence.total_seconds() / 86400,
        thresholds=asdict(thresholds),
        groups=[
            _group(
                name,
                grouped[name],
                (missed_by_group[name], unplaced[name]),
                by_node,
                failures,
                modes_now.get(name),
                own.get(name, thresholds),
                settings,
            )
            for name in names
        ],
    )


def _at(record: DecisionFact | PeopleChange) -> datetime:
    return record.at


def _first_per_incident(decisions: Iterable[DecisionFact]) -> list[DecisionFact]:
    first: dict[str, DecisionFact] = {}
    for d in sorted(decisions, key=_at):
        first.setdefault(d.incident, d)
    return sorted(first.values(), key=_at)


def _our_misses(
    changes: list[PeopleChange], calls: list[DecisionFact], window: timedelta, since: datetime | None
) -> list[PeopleChange]:
    """People's actions with no decision on the node in the window before; an action within the window
    after another of people's on the node is the same response (a reboot is requested, then done)."""
    decided: defaultdict[str, list[datetime]] = defaultdict(list)
    for d in calls:
        decided[d.node].append(d.at)
    misses = []
    last_action: dict[str, datetime] = {}
    for c in changes:
        if c.change not in PEOPLE_ACTIONS:
            continue
        before = last_action.get(c.node)
        last_action[c.node] = c.at
        if before is not None and c.at - before <= window:
            continue
        if any(c.at - window <= at <= c.at for at in decided[c.node]):
            continue
        if since is None or c.at >= since:
            misses.append(c)
    return misses


def _group(
    name: str,
    calls: list[DecisionFact],
    misses: tuple[list[str], list[Unplaced]],
    by_node: Mapping[str, list[PeopleChange]],
    failures: Mapping[str, list[Opened]],
    mode_now: str | None,
    thresholds: Thresholds,
    settings: _Settings,
) -> Group:
    acting = [d for d in calls if d.action in AGREES]
    observed = [d for d in acting if d.mode == "observe"]
    pairs = [_pair(d, by_node.get(d.node, []), failures.get(d.node, []), settings) for d in observed]
    verdicts = [p.verdict for p in pairs]
    saved = [p.saved_minutes for p in pairs if p.saved_minutes is not None]
    destructive = sum(p.action in DESTRUCTIVE and p.verdict in ("disagreed", "false_alarm") for p in pairs)
    readiness = _readiness(pairs, destructive, thresholds)
    missed, unplaced = misses
    return Group(
        name=name,
        mode_now=mode_now,
        modes=_modes(acting),
        would_have=len(pairs),
        agreed=verdicts.count("agreed"),
        disagreed=verdicts.count("disagreed"),
        missed_by_people=verdicts.count("missed_by_people"),
        false_alarm=verdicts.count("false_alarm"),
        pending=verdicts.count("pending"),
        destructive_disagreements=destructive,
        our_misses=len(missed),
        saved_minutes_median=statistics.median(saved) if saved else None,
        saved_minutes_total=sum(saved),
        readiness=readiness,
        pairs=pairs,
        missed=missed,
        thresholds=asdict(thresholds),
        unplaced=unplaced,
    )


def _pair(
    decision: DecisionFact, changes: list[PeopleChange], failures: list[Opened], settings: _Settings
) -> Pair:
    end = decision.at + settings.window
    seen = [c for c in changes if decision.at <= c.at <= end]
    agreeing = [c for c in seen if c.change in AGREES[decision.action]]
    answer = agreeing[0] if agreeing else (seen[0] if seen else None)
    if agreeing:
        verdict = "agreed"
    elif seen:
        verdict = "disagreed"
    elif any(
        o.incident != decision.incident and decision.at < o.at <= decision.at + settings.recurrence
        for o in failures
    ):
        verdict = "missed_by_people"
    elif decision.at + settings.recurrence > settings.now:
        verdict = "pending"
    else:
        verdict = "false_alarm"
    return Pair(
        incident=decision.incident,
        node=decision.node,
        decided_at=decision.at,
        action=decision.action,
        rule=decision.rule,
        verdict=verdict,
        people_change=answer.change if answer else None,
        people_at=answer.at if answer else None,
        saved_minutes=(answer.at - decision.at).total_seconds() / 60 if agreeing and answer else None,
    )


def _modes(acting: list[DecisionFact]) -> list[ModeCount]:
    by_mode: defaultdict[str, list[datetime]] = defaultdict(list)
    for d in acting:
        by_mode[d.mode or "remediate"].append(d.at)
    return [
        ModeCount(mode=mode, decisions=len(times), first_at=min(times), last_at=max(times))
        for mode, times in sorted(by_mode.items(), key=lambda item: min(item[1]))
    ]


def _readiness(pairs: list[Pair], destructive: int, thresholds: Thresholds) -> Readiness:
    """Agreement is the share of judged would-have decisions that people's actions or the node's next
    failure bore out (agreed or missed by people); a pending one is not judged yet."""
    judged = [p for p in pairs if p.verdict != "pending"]
    right = sum(p.verdict in ("agreed", "missed_by_people") for p in judged)
    agreement = right / len(judged) if judged else None
    reasons = []
    if len(pairs) < thresholds.decisions:
        reasons.append(f"{len(pairs)} would-have decisions, fewer than {thresholds.decisions}")
    if agreement is None or agreement < thresholds.agreement:
        shown = "none judged" if agreement is None else f"{agreement:.1%}"
        reasons.append(f"agreement {shown}, below {thresholds.agreement:.0%}")
    if destructive > thresholds.destructive_disagreements:
        reasons.append(
            f"{destructive} destructive disagreements, more than {thresholds.destructive_disagreements}"
        )
    return Readiness(ready=not reasons, agreement=agreement, reasons=reasons)
