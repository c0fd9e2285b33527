"""Why a decision came out as it did: every rule, whether it matched, and on what."""

from __future__ import annotations

from dataclasses import dataclass

from medic.facts import Facts
from medic.policy.engine import compiled, diagnose_level, evaluate
from medic.policy.model import Action, Policy


@dataclass(frozen=True, slots=True)
class RuleTrace:
    rule: str
    action: str
    matched: bool
    reasons: tuple[str, ...]
    failed_on: str | None  # the first condition that did not hold
    note: str | None  # e.g. the incident has no event a condition needs
    precedence: tuple[bool, int, int, int]


def trace(policy: Policy, facts: Facts) -> list[RuleTrace]:
    """Every rule in file order, evaluated in full (no shortcuts), for people to read."""
    traces = []
    for rule in compiled(policy).rules:
        reasons, failed = evaluate(rule, facts)
        note = None
        missing = [need for need in rule.needs if facts.kinds.isdisjoint(need)]
        if missing:
            note = "needs events of kind " + " and ".join(
                "/".join(sorted(k.value for k in n)) for n in missing
            )
        matched = reasons is not None
        if matched and rule.rule.then.action is Action.DIAGNOSE and diagnose_level(rule.rule, facts) is None:
            matched, note = False, f"level {rule.rule.then.diagnose_level} already ran for this incident"
        traces.append(
            RuleTrace(
                rule=rule.rule.id,
                action=rule.rule.then.action.value,
                matched=matched,
                reasons=tuple(reasons or ()),
                failed_on=failed,
                note=note,
                precedence=rule.precedence,
            )
        )
    return traces


def describe(facts: Facts) -> dict[str, str]:
    """The facts rules look at, as short strings (only those that are present)."""
    shown = {
        "node": facts.node,
        "switch": facts.switch or "",
        "events": str(facts.event_count),
        "kinds": ", ".join(sorted(k.value for k in facts.kinds)),
        "xid": ", ".join(map(str, sorted(facts.xid_codes))),
        "xid catalog": ", ".join(sorted(facts.xid_resolutions)),
        "xid 154 action": ", ".join(sorted(facts.recovery_actions)),
        "nvswitch sxid": ", ".join(map(str, sorted(facts.sxids))),
        "row remap": ", ".join(sorted(facts.row_remap)),
        "nvlink errors": str(facts.nvlink_errors) if facts.nvlink_errors else "",
        "dcgm health": ", ".join(sorted(facts.dcgm_errors)),
        "dcgm severity": ", ".join(sorted(s.value for s in facts.dcgm_severities)),
        "dcgm category": ", ".join(sorted(facts.dcgm_categories)),
        "ecc dbe/sbe": f"{facts.ecc_dbe}/{facts.ecc_sbe}" if facts.ecc_dbe or facts.ecc_sbe else "",
        "stragglers": f"{facts.straggler_reports} (max {facts.straggler_max_ratio:g}x)"
        if facts.straggler_reports
        else "",
        "straggler cause": verdict.describe() if (verdict := facts.straggler_verdict) else "",
        "diagnostics": ", ".join(f"L{d.level} {d.result}" for d in facts.diagnostics),
        "jobs": ", ".join(facts.jobs),
        "gpus": ", ".join(map(str, facts.gpus)),
        "out of service": "yes" if facts.out_of_service else "",
        "remediations in 7 days": str(facts.recent_remediations) if facts.recent_remediations else "",
        "earlier gpu incidents": str(len(facts.gpu_history)) if facts.gpu_history else "",
    }
    return {k: v for k, v in shown.items() if v}
