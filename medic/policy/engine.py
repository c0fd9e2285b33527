"""The policy engine: facts in, decision out. Pure, deterministic, no I/O.

Precedence when several rules match (docs/policy.md): a rule marked `override` beats every
rule without it; then the most far-reaching action wins (replace > reboot > reset_gpu >
diagnose > drain > escalate > reintegrate > none); then the higher `priority`; then the
rule written first.

A `diagnose` rule is satisfied once its level has run for the incident: it stops matching,
so the next decision is made on the diagnostic result instead of asking for the same test.
"""

from __future__ import annotations

from collections.abc import Callable

from medic.facts import Facts
from medic.policy.model import ACTION_RANK, Action, Decision, Policy, Rule, When

MAX_LEVEL = 4

Check = Callable[[When, Facts], str | None]


def _kinds(when: When, f: Facts) -> str | None:
    hit = sorted(k.value for k in f.kinds if k in when.kinds)  # type: ignore[operator]
    return f"kind {', '.join(hit)}" if hit else None


def _not_kinds(when: When, f: Facts) -> str | None:
    present = f.kinds.intersection(when.not_kinds or ())
    return None if present else f"no {', '.join(k.value for k in when.not_kinds or ())}"


def _xid(when: When, f: Facts) -> str | None:
    hit = sorted(f.xid_codes.intersection(when.xid or ()))
    return f"XID {', '.join(map(str, hit))}" if hit else None


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


# Cheap, selective checks first: most rules fail on their first condition.
CHECKS: tuple[tuple[str, Check], ...] = (
    ("kinds", _kinds),
    ("xid", _xid),
    ("dcgm_errors", _dcgm_errors),
    ("dcgm_severity", _dcgm_severity),
    ("ecc_dbe_at_least", _ecc),
    ("straggler", _straggler),
    ("diagnostic", _diagnostic),
    ("out_of_service", _out_of_service),
    ("recent_remediations_at_least", _recent),
    ("recent_remediations_at_most", _recent_at_most),
    ("min_events", _min_events),
    ("not_kinds", _not_kinds),
)


def match(rule: Rule, facts: Facts) -> list[str] | None:
    """The reasons each condition of `rule` holds, or None when one does not."""
    reasons: list[str] = []
    when = rule.when
    for name, check in CHECKS:
        if getattr(when, name) is None:
            continue
        reason = check(when, facts)
        if reason is None:
            return None
        if reason not in reasons:  # at_least and at_most on one count read the same
            reasons.append(reason)
    return reasons


def _diagnose_level(rule: Rule, facts: Facts) -> int | None:
    """The level a diagnose rule asks for now, or None when that level has already run."""
    wanted = rule.then.diagnose_level
    level = facts.highest_level_run + 1 if wanted == "next" else int(wanted or 1)
    return level if level > facts.highest_level_run else None


def _precedence(rule: Rule, index: int) -> tuple[bool, int, int, int]:
    return (rule.override, ACTION_RANK[rule.then.action], rule.priority, -index)


def decide(policy: Policy, facts: Facts, policy_sha256: str = "") -> Decision:
    candidates: list[tuple[tuple[bool, int, int, int], Rule, list[str], int | None]] = []
    for index, rule in enumerate(policy.rules):
        reasons = match(rule, facts)
        if reasons is None:
            continue
        level = None
        if rule.then.action is Action.DIAGNOSE:
            level = _diagnose_level(rule, facts)
            if level is None:
                continue
        candidates.append((_precedence(rule, index), rule, reasons, level))

    if not candidates:
        return Decision(
            incident=facts.incident,
            classification=policy.defaults.classification,
            action=policy.defaults.action,
            rule="default",
            reason="no rule matched; the policy's default applies",
            policy_sha256=policy_sha256,
        )

    candidates.sort(key=lambda c: c[0], reverse=True)
    _, rule, reasons, level = candidates[0]
    then = rule.then
    action, reason = then.action, f"{rule.description}: {'; '.join(reasons)}"
    if level is not None and level > min(policy.defaults.max_diagnose_level, MAX_LEVEL):
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
        matched=[c[1].id for c in candidates],
        policy_sha256=policy_sha256,
    )
