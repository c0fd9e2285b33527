"""The policy engine: facts in, decision out. Pure, deterministic, no I/O.

Precedence when several rules match (docs/policy.md): a rule marked `override` beats every
rule without it; then the most far-reaching action wins (replace > reboot > reset_gpu >
diagnose > drain > escalate > reintegrate > none); then the higher `priority`; then the
rule written first.

A `diagnose` rule is satisfied once its level has run for the incident: it stops matching,
so the next decision is made on the diagnostic result instead of asking for the same test.

Each condition has two forms: a check that says why it holds (`CHECKS`, the semantics, used for
the winner's reasons and by `medic policy explain`) and a yes/no test compiled from it once per
policy (`_test`), which `decide` runs. tests/domain/test_engine_compiled.py holds them to the same answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from medic import xid as xid_catalog
from medic.context import Seen
from medic.events import EventKind, FaultEvent
from medic.facts import Facts
from medic.policy.model import (
    ACTION_RANK,
    Action,
    CountCondition,
    Decision,
    Policy,
    Rule,
    Signature,
    When,
)

MAX_LEVEL = 4

Check = Callable[[When, Facts], str | None]


def _kinds(when: When, f: Facts) -> str | None:
    hit = sorted(k.value for k in f.kinds.intersection(when.kinds or ()))
    return f"kind {', '.join(hit)}" if hit else None


def _not_kinds(when: When, f: Facts) -> str | None:
    present = f.kinds.intersection(when.not_kinds or ())
    return None if present else f"no {', '.join(k.value for k in when.not_kinds or ())}"


def _xid(when: When, f: Facts) -> str | None:
    hit = sorted(f.xid_codes.intersection(when.xid or ()))
    return f"XID {', '.join(map(str, hit))}" if hit else None


def _xid_resolution(when: When, f: Facts) -> str | None:
    wanted = set(when.xid_resolution or ())
    hit = sorted(c for c in f.xid_codes if xid_catalog.resolution(c) in wanted)
    if not hit:
        return None
    return ", ".join(f"XID {c} (catalog {xid_catalog.resolution(c).value})" for c in hit)


def _xid_recovery_action(when: When, f: Facts) -> str | None:
    hit = sorted(f.recovery_actions.intersection(when.xid_recovery_action or ()))
    return f"XID 154 recovery action {', '.join(hit)}" if hit else None


def _row_remap(when: When, f: Facts) -> str | None:
    hit = sorted(f.row_remap.intersection(when.row_remap or ()))
    return f"row remap {', '.join(hit)}" if hit else None


def _nvlink_errors(when: When, f: Facts) -> str | None:
    if f.nvlink_errors >= (when.nvlink_errors_at_least or 0) and f.nvlink_errors > 0:
        return f"{f.nvlink_errors} NVLink errors"
    return None


def _sxid(when: When, f: Facts) -> str | None:
    hit = sorted(f.sxid_severities.intersection(when.sxid or ()))
    if not hit:
        return None
    return f"NVSwitch SXid {', '.join(map(str, sorted(f.sxids)))} ({', '.join(hit)})"


def _dcgm_errors(when: When, f: Facts) -> str | None:
    hit = sorted(f.dcgm_errors.intersection(when.dcgm_errors or ()))
    return f"DCGM health {', '.join(hit)}" if hit else None


def _dcgm_severity(when: When, f: Facts) -> str | None:
    hit = sorted(s.value for s in f.dcgm_severities.intersection(when.dcgm_severity or ()))
    return f"DCGM health severity {', '.join(hit)}" if hit else None


def _ecc(when: When, f: Facts) -> str | None:
    return f"{f.ecc_dbe} double-bit ECC errors" if f.ecc_dbe >= (when.ecc_dbe_at_least or 0) else None


def _straggler(when: When, f: Facts) -> str | None:
    cond = when.straggler
    assert cond is not None
    if f.straggler_reports >= cond.reports_at_least and f.straggler_max_ratio >= cond.ratio_at_least:
        return f"{f.straggler_reports} straggler reports, step time up to {f.straggler_max_ratio:g}x"
    return None


def _straggler_cause(when: When, f: Facts) -> str | None:
    verdict = f.straggler_verdict
    if verdict is None or verdict.cause not in (when.straggler_cause or ()):
        return None  # no verdict is no cause: a rule that names causes leaves the incident to the others
    return f"straggler cause {verdict.describe()}"


def _diagnostic(when: When, f: Facts) -> str | None:
    cond, latest = when.diagnostic, f.latest_diagnostic
    assert cond is not None
    if latest is None:
        return None
    if cond.result is not None and latest.result != cond.result:
        return None
    if cond.level_at_least is not None and latest.level < cond.level_at_least:
        return None
    if cond.worst_severity is not None and latest.worst_severity not in cond.worst_severity:
        return None
    errors = f" ({', '.join(latest.error_names)})" if latest.error_names else ""
    return f"DCGM level {latest.level} {latest.result}{errors}"


def _out_of_service(when: When, f: Facts) -> str | None:
    if f.out_of_service == when.out_of_service:
        return "node out of service" if f.out_of_service else "node in service"
    return None


def _recent(when: When, f: Facts) -> str | None:
    if f.recent_remediations >= (when.recent_remediations_at_least or 0):
        return f"{f.recent_remediations} remediations on this node in 7 days"
    return None


def _recent_at_most(when: When, f: Facts) -> str | None:
    limit = when.recent_remediations_at_most
    assert limit is not None
    if f.recent_remediations <= limit:
        return f"{f.recent_remediations} remediations on this node in 7 days"
    return None


def _min_events(when: When, f: Facts) -> str | None:
    return f"{f.event_count} events" if f.event_count >= (when.min_events or 0) else None


def _dcgm_category(when: When, f: Facts) -> str | None:
    hit = sorted(f.dcgm_categories.intersection(when.dcgm_category or ()))
    return f"DCGM health category {', '.join(hit)}" if hit else None


def _window_end(f: Facts) -> datetime:
    """Windows end at the incident's newest fault evidence (not at the moment of deciding): a
    decision taken again after a 30-minute diagnostic must still see the storm that opened it."""
    faults = [e.time for e in f.events if e.kind is not EventKind.DIAGNOSTIC]
    return min(max(faults), f.now) if faults else f.now


def window(f: Facts, within: timedelta) -> tuple[datetime, datetime]:
    """The stretch of the cluster's events a windowed condition looking back `within` reads."""
    end = _window_end(f)
    return end - within, end


def has_signature(sig: Signature, event: Seen) -> bool:
    if event.kind is EventKind.XID and sig.xid:
        return event.attributes["code"] in sig.xid
    return event.kind in (sig.kinds or ())


def counted(cond: CountCondition, f: Facts, kinds: tuple[EventKind, ...]) -> int:
    """How many distinct things the condition counts in its window (0 without an anchor, and below
    `at_least` where too few events of its `kinds` lie in the window to reach it)."""
    anchors = [e for e in f.events if has_signature(cond, e)]
    if not anchors:
        return 0
    start, end = window(f, timedelta(minutes=cond.within_minutes))
    lookups = _lookups(cond, f, anchors)
    reach = sum(f.context.count(kinds, start, end, scope, key) for scope, key in lookups)
    if len(anchors) + reach < cond.at_least:
        return 0  # not enough events of these kinds where it looks: skip the careful count
    pool: dict[str, Seen] = {e.id: e for e in anchors if start <= e.time <= end}
    for scope, key in lookups:
        pool.update(
            (e.id, e) for e in f.context.window(kinds, start, end, scope, key) if has_signature(cond, e)
        )
    found = list(pool.values())
    if cond.scope == "gpu":
        gpus = {(e.node, e.gpu) for e in anchors if e.gpu is not None}
        found = [e for e in found if (e.node, e.gpu) in gpus]
    elif cond.scope == "node":
        found = [e for e in found if e.node == f.node]
    elif cond.scope == "job":
        jobs = {e.job for e in anchors if e.job}
        found = [e for e in found if e.job in jobs]
    if cond.same_iteration_rank:
        marks = {(e.iteration, e.rank) for e in anchors if e.iteration is not None and e.rank is not None}
        found = [e for e in found if (e.iteration, e.rank) in marks]
    if cond.distinct == "events":
        n = len(found)
    elif cond.distinct == "episodes":
        gap = timedelta(minutes=cond.episode_gap_minutes)
        times = sorted(e.time for e in found)
        n = sum(1 for i, t in enumerate(times) if i == 0 or t - times[i - 1] > gap)
    elif cond.distinct == "nodes":
        n = len({e.node for e in found})
    elif cond.distinct == "jobs":
        n = len({e.job for e in found if e.job})
    else:
        n = len({(e.node, e.gpu) for e in found if e.gpu is not None})
    return n


def _one_count(cond: CountCondition, f: Facts) -> str | None:
    n = counted(cond, f, cond.event_kinds())
    if n < cond.at_least:
        return None
    where = {"gpu": "on this GPU", "node": "on this node", "job": "in this job", "cluster": "in the cluster"}
    same = " at the same iteration and rank" if cond.same_iteration_rank else ""
    return f"{n} {cond.distinct} with {cond.describe()}{same} {where[cond.scope]} within {cond.within_minutes} min"


def _lookups(cond: CountCondition, f: Facts, anchors: list[FaultEvent]) -> list[tuple[str | None, object]]:
    """Which slices of the cluster index can hold matching events (the narrowest that suffices)."""
    if cond.same_iteration_rank:
        return [
            ("mark", m)
            for m in {
                (e.iteration, e.rank) for e in anchors if e.iteration is not None and e.rank is not None
            }
        ]
    if cond.scope in ("gpu", "node"):
        return [("node", n) for n in {e.node for e in anchors}] if cond.scope == "gpu" else [("node", f.node)]
    if cond.scope == "job":
        return [("job", j) for j in {e.job for e in anchors if e.job}]
    return [(None, None)]


def _count(when: When, f: Facts) -> str | None:
    reasons = []
    for cond in when.count or ():
        reason = _one_count(cond, f)
        if reason is None:
            return None
        reasons.append(reason)
    return "; ".join(reasons)


def _switch(when: When, f: Facts) -> str | None:
    cond = when.switch
    assert cond is not None
    if f.switch is None:
        return None
    start, end = window(f, timedelta(minutes=cond.within_minutes))
    own = {e.node for e in f.events if e.kind in cond.kinds and start <= e.time <= end}
    if not own:
        return None
    nodes = own | {e.node for e in f.context.window(cond.kinds, start, end, "switch", f.switch)}
    size = f.context.switch_sizes.get(f.switch)
    enough = cond.nodes_at_least is not None and len(nodes) >= cond.nodes_at_least
    share = (
        cond.fraction_at_least is not None
        and size is not None
        and size > 0
        and len(nodes) / size >= cond.fraction_at_least
    )
    if not (enough or share):
        return None
    of = f" of {size}" if size else ""
    kinds = "/".join(k.value for k in cond.kinds)
    return f"{len(nodes)}{of} nodes under {f.switch} report {kinds} within {cond.within_minutes} min"


def _gpu_incidents(when: When, f: Facts) -> str | None:
    cond = when.gpu_incidents
    assert cond is not None
    start = f.now - timedelta(days=cond.within_days)
    for gpu in f.gpus:
        past = [
            p for p in f.gpu_history if gpu in p.gpus and p.blames_hardware and start <= p.opened_at <= f.now
        ]
        jobs = sorted(set(f.jobs).union(*(p.jobs for p in past)))
        if len(past) + 1 >= cond.at_least and len(jobs) >= cond.distinct_jobs_at_least:
            across = f" across {len(jobs)} jobs ({', '.join(jobs)})" if jobs else ""
            return f"{len(past) + 1} incidents on GPU {gpu} within {cond.within_days} days{across}"
    return None


# Cheap, selective checks first: most rules fail on their first condition.
CHECKS: tuple[tuple[str, Check], ...] = (
    ("kinds", _kinds),
    ("xid", _xid),
    ("xid_resolution", _xid_resolution),
    ("xid_recovery_action", _xid_recovery_action),
    ("sxid", _sxid),
    ("row_remap", _row_remap),
    ("nvlink_errors_at_least", _nvlink_errors),
    ("dcgm_errors", _dcgm_errors),
    ("dcgm_severity", _dcgm_severity),
    ("dcgm_category", _dcgm_category),
    ("ecc_dbe_at_least", _ecc),
    ("straggler", _straggler),
    ("straggler_cause", _straggler_cause),
    ("diagnostic", _diagnostic),
    ("out_of_service", _out_of_service),
    ("recent_remediations_at_least", _recent),
    ("recent_remediations_at_most", _recent_at_most),
    ("min_events", _min_events),
    ("not_kinds", _not_kinds),
    ("gpu_incidents", _gpu_incidents),
    # Windowed counts scan the cluster's recent events: last, once everything cheap has held.
    ("switch", _switch),
    ("count", _count),
)

FactTest = Callable[[Facts], bool]

# Conditions that read only the incident's kinds and XID codes (its shape): a rule failing one
# of them is dropped once per shape, not tested per decision.
SHAPE_CONDITIONS = frozenset({"kinds", "not_kinds", "xid", "xid_resolution"})


def _test(name: str, when: When, check: Check) -> FactTest:
    """The yes/no form of one condition, its parameters read once: `decide` tests every candidate
    rule with these and builds the reason strings for the winner only."""
    match name:
        case "kinds":
            kinds = frozenset(when.kinds or ())
            return lambda f: not f.kinds.isdisjoint(kinds)
        case "not_kinds":
            absent = frozenset(when.not_kinds or ())
            return lambda f: f.kinds.isdisjoint(absent)
        case "xid":
            codes = frozenset(when.xid or ())
            return lambda f: not f.xid_codes.isdisjoint(codes)
        case "xid_resolution":
            buckets = frozenset(when.xid_resolution or ())
            return lambda f: not f.xid_resolutions.isdisjoint(buckets)
        case "xid_recovery_action":
            actions = frozenset(when.xid_recovery_action or ())
            return lambda f: not f.recovery_actions.isdisjoint(actions)
        case "sxid":
            severities = frozenset(when.sxid or ())
            return lambda f: not f.sxid_severities.isdisjoint(severities)
        case "row_remap":
            states = frozenset(when.row_remap or ())
            return lambda f: not f.row_remap.isdisjoint(states)
        case "dcgm_errors":
            errors = frozenset(when.dcgm_errors or ())
            return lambda f: not f.dcgm_errors.isdisjoint(errors)
        case "dcgm_severity":
            dcgm_severities = frozenset(when.dcgm_severity or ())
            return lambda f: not f.dcgm_severities.isdisjoint(dcgm_severities)
        case "dcgm_category":
            categories = frozenset(when.dcgm_category or ())
            return lambda f: not f.dcgm_categories.isdisjoint(categories)
        case "nvlink_errors_at_least":
            rises = max(when.nvlink_errors_at_least or 0, 1)
            return lambda f: f.nvlink_errors >= rises
        case "ecc_dbe_at_least":
            dbe = when.ecc_dbe_at_least or 0
            return lambda f: f.ecc_dbe >= dbe
        case "straggler":
            assert when.straggler is not None
            reports, ratio = when.straggler.reports_at_least, when.straggler.ratio_at_least
            return lambda f: f.straggler_reports >= reports and f.straggler_max_ratio >= ratio
        case "out_of_service":
            out = when.out_of_service
            return lambda f: f.out_of_service == out
        case "recent_remediations_at_least":
            least = when.recent_remediations_at_least or 0
            return lambda f: f.recent_remediations >= least
        case "recent_remediations_at_most":
            most = when.recent_remediations_at_most or 0
            return lambda f: f.recent_remediations <= most
        case "min_events":
            events = when.min_events or 0
            return lambda f: f.event_count >= events
        case "count":
            # Each condition's kinds worked out once, and no reason worded for a count that holds.
            counts = tuple((cond, cond.event_kinds()) for cond in when.count or ())
            return lambda f: all(counted(cond, f, kinds) >= cond.at_least for cond, kinds in counts)
        case "gpu_incidents":
            assert when.gpu_incidents is not None
            least = when.gpu_incidents.at_least
            # Most nodes have no history: skip the count unless enough incidents exist at all.
            return lambda f: len(f.gpu_history) + 1 >= least and check(when, f) is not None
    return lambda f: check(when, f) is not None


def _all(tests: tuple[FactTest, ...]) -> FactTest | None:
    """One test for a rule's per-decision conditions (None: nothing left to test)."""
    if not tests:
        return None
    if len(tests) == 1:
        return tests[0]
    return lambda f: all(test(f) for test in tests)


# Each condition only holds when the incident has events of these kinds: a rule whose
# requirements the incident cannot meet is dropped without evaluating anything.
_NEEDS: dict[str, frozenset[EventKind]] = {
    "xid": frozenset({EventKind.XID}),
    "xid_resolution": frozenset({EventKind.XID}),
    "xid_recovery_action": frozenset({EventKind.XID}),
    "sxid": frozenset({EventKind.HEALTH_CHECK}),
    "nvlink_errors_at_least": frozenset({EventKind.HEALTH_CHECK}),
    "dcgm_errors": frozenset({EventKind.DCGM_HEALTH}),
    "dcgm_severity": frozenset({EventKind.DCGM_HEALTH}),
    "dcgm_category": frozenset({EventKind.DCGM_HEALTH}),
    "ecc_dbe_at_least": frozenset({EventKind.ECC}),
    "straggler": frozenset({EventKind.STRAGGLER}),
    "straggler_cause": frozenset({EventKind.STRAGGLER}),
    "diagnostic": frozenset({EventKind.DIAGNOSTIC}),
}


@dataclass(frozen=True, slots=True)
class CompiledRule:
    rule: Rule
    index: int
    needs: tuple[frozenset[EventKind], ...]
    checks: tuple[tuple[str, Check], ...]
    shape_tests: tuple[FactTest, ...]  # the needs and the conditions on the incident's shape
    test: FactTest | None  # every other condition, yes/no only
    precedence: tuple[bool, int, int, int]

    def fits(self, facts: Facts) -> bool:
        """Whether the conditions on the incident's shape hold (the same for every incident of it)."""
        return all(test(facts) for test in self.shape_tests)


def _needs_test(need: frozenset[EventKind]) -> FactTest:
    return lambda f: not f.kinds.isdisjoint(need)


def compile_rule(rule: Rule, index: int) -> CompiledRule:
    when = rule.when
    checks = tuple((name, check) for name, check in CHECKS if getattr(when, name) is not None)
    needs = [_NEEDS[name] for name, _ in checks if name in _NEEDS]
    if when.kinds:
        needs.append(frozenset(when.kinds))
    needs.extend(frozenset(c.event_kinds()) for c in when.count or ())
    if when.switch:
        needs.append(frozenset(when.switch.kinds))
    shape = [_needs_test(need) for need in dict.fromkeys(needs)]
    shape += [_test(name, when, check) for name, check in checks if name in SHAPE_CONDITIONS]
    rest = tuple(_test(name, when, check) for name, check in checks if name not in SHAPE_CONDITIONS)
    precedence = (rule.override, ACTION_RANK[rule.then.action], rule.priority, -index)
    return CompiledRule(rule, index, tuple(needs), checks, tuple(shape), _all(rest), precedence)


# The incident's shape: what the shape conditions read.
Shape = tuple[frozenset[EventKind], frozenset[int], frozenset[str]]
MAX_SHAPES = 4096  # incidents come in few shapes; a flood of odd ones must not grow the cache


@dataclass(frozen=True, slots=True)
class CompiledPolicy:
    rules: tuple[CompiledRule, ...]  # in file order
    ranked: tuple[CompiledRule, ...]  # the same, the rule that wins first
    # Each shape's candidates, ranked: the rules whose shape conditions hold for it.
    seen: dict[Shape, tuple[CompiledRule, ...]] = field(default_factory=dict)

    def candidates(self, facts: Facts) -> tuple[CompiledRule, ...]:
        shape = (facts.kinds, facts.xid_codes, facts.xid_resolutions)
        hit = self.seen.get(shape)
        if hit is None:
            hit = tuple(rule for rule in self.ranked if rule.fits(facts))
            if len(self.seen) < MAX_SHAPES:
                self.seen[shape] = hit
        return hit


def _compile_policy(policy: Policy) -> CompiledPolicy:
    rules = tuple(compile_rule(rule, i) for i, rule in enumerate(policy.rules))
    return CompiledPolicy(rules, tuple(sorted(rules, key=lambda r: r.precedence, reverse=True)))


_compiled: OrderedDict[int, tuple[Policy, CompiledPolicy]] = OrderedDict()


def compiled(policy: Policy) -> CompiledPolicy:
    """The policy compiled once (a few recently used policies are kept)."""
    key = id(policy)
    hit = _compiled.get(key)
    if hit is not None and hit[0] is policy and next(reversed(_compiled)) == key:
        return hit[1]  # the one used last: most calls, no reordering
    if hit is not None and hit[0] is policy:
        _compiled.move_to_end(key)
        return hit[1]
    result = _compile_policy(policy)
    _compiled[key] = (policy, result)
    if len(_compiled) > 16:
        _compiled.popitem(last=False)
    return result


def evaluate(compiled_rule: CompiledRule, facts: Facts) -> tuple[list[str] | None, str | None]:
    """(the reason each condition holds, None) or (None, the first condition that does not)."""
    reasons: list[str] = []
    when = compiled_rule.rule.when
    for name, check in compiled_rule.checks:
        reason = check(when, facts)
        if reason is None:
            return None, name
        if reason not in reasons:  # at_least and at_most on one count read the same
            reasons.append(reason)
    return reasons, None


def match(rule: Rule, facts: Facts) -> list[str] | None:
    """The reasons each condition of `rule` holds, or None when one does not."""
    return evaluate(compile_rule(rule, 0), facts)[0]


def diagnose_level(rule: Rule, facts: Facts) -> int | None:
    """The level a diagnose rule asks for now, or None when the rule's levels have all run."""
    then, highest = rule.then, facts.highest_level_run
    if then.diagnose_level == "next":
        return highest + 1
    start = int(then.diagnose_level or 1)
    if highest >= (then.diagnose_up_to or start):
        return None
    return max(start, highest + 1)


Ruling = tuple[str, Action, int | None]  # a decision's rule, action and diagnose level


def _matches(policy: Policy, facts: Facts) -> Iterator[tuple[CompiledRule, int | None]]:
    """The rules that match, the winner first, each with the diagnose level it asks for."""
    for compiled_rule in compiled(policy).candidates(facts):
        test = compiled_rule.test
        if test is not None and not test(facts):
            continue
        rule = compiled_rule.rule
        level = None
        if rule.then.action is Action.DIAGNOSE:
            level = diagnose_level(rule, facts)
            if level is None:
                continue
        yield compiled_rule, level


def _exhausted(policy: Policy, level: int | None) -> bool:
    """Whether a diagnose rule asks for a level beyond the policy's highest: humans decide."""
    return level is not None and level > min(policy.defaults.max_diagnose_level, MAX_LEVEL)


def ruling(policy: Policy, facts: Facts) -> Ruling:
    """The rule, action and diagnose level of `decide`'s decision, without the rest: a replay compares
    only these, and stops at the winner where `decide` tests every rule and words its reasons."""
    winner = next(_matches(policy, facts), None)
    if winner is None:
        return "default", policy.defaults.action, None
    compiled_rule, level = winner
    if _exhausted(policy, level):
        return compiled_rule.rule.id, Action.ESCALATE, None
    return compiled_rule.rule.id, compiled_rule.rule.then.action, level


def decide(policy: Policy, facts: Facts, policy_sha256: str = "") -> Decision:
    """The decision on one incident: the winning rule's, or the policy's default when none matches.

    Every matching rule is recorded (`matched`, winner first); only the winner's reasons are built.
    """
    matched = list(_matches(policy, facts))
    if not matched:
        return Decision(
            incident=facts.incident,
            classification=policy.defaults.classification,
            action=policy.defaults.action,
            rule="default",
            reason="no rule matched; the policy's default applies",
            policy_sha256=policy_sha256,
        )

    winner, level = matched[0]
    reasons = evaluate(winner, facts)[0] or []
    rule, then = winner.rule, winner.rule.then
    action, reason = then.action, f"{rule.description}: {'; '.join(reasons)}"
    if _exhausted(policy, level):
        action, level = Action.ESCALATE, None
        reason += f"; diagnostics exhausted at level {facts.highest_level_run}, humans decide"
    return Decision(
        incident=facts.incident,
        classification=then.classification,
        action=action,
        diagnose_level=level,
        rule=rule.id,
        reason=reason,
        recommend=list(then.recommend),
        owner=then.owner,
        approve=then.approve or action in policy.approvals.required_for,
        matched=[c.rule.id for c, _ in matched],
        policy_sha256=policy_sha256,
    )
