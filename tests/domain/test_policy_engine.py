"""The decision engine on small inline policies: precedence, defaults, diagnose levels, records."""

from __future__ import annotations

from functools import partial

import pytest
from factories import fault_event

from medic.events import FaultEvent
from medic.facts import Facts, facts_of
from medic.incidents import correlate
from medic.policy import Action, Policy, decide
from medic.policy.loader import parse_policy
from medic.policy.model import ACTION_RANK

SHA = "ab" * 32


event = partial(fault_event, node="node-a", gpu=0)  # event(kind, minutes=..., **attributes)


def diag(level: int, result: str = "fail", *error_ids: int | str, minutes: float = 1) -> FaultEvent:
    return event("diagnostic", minutes=minutes + level, level=level, result=result, error_ids=list(error_ids))


def facts(*events: FaultEvent, out_of_service: bool = False) -> Facts:
    (incident,) = correlate(events)
    return facts_of(incident, out_of_service=out_of_service)


def rule(rule_id: str, when: str, action: str, *, extra: str = "", then: str = "") -> str:
    """One rule as YAML (indented for a `rules:` list); `extra` adds rule keys, `then` adds then keys."""
    level = "\n      diagnose_level: 1" if action == "diagnose" and "diagnose_level" not in then else ""
    return f"""
  - id: {rule_id}
    description: Rule {rule_id}{extra}
    when: {when}
    then:
      classification: hardware
      action: {action}{level}{then}
"""


def policy(*rules: str, defaults: str = "") -> Policy:
    return parse_policy(f"version: 1\n{defaults}\nrules:{''.join(rules)}", "inline.yaml")


NCCL = facts(event("nccl_timeout"))


# --- Precedence -----------------------------------------------------------------------------


def test_override_beats_action_rank():
    p = policy(
        rule("big", "{kinds: [nccl_timeout]}", "replace", extra="\n    priority: 100"),
        rule("small", "{kinds: [nccl_timeout]}", "none", extra="\n    override: true"),
    )
    decision = decide(p, NCCL)
    assert (decision.rule, decision.action) == ("small", Action.NONE)
    assert decision.matched == ["small", "big"]


def test_action_rank_beats_priority():
    p = policy(
        rule("reset", "{kinds: [nccl_timeout]}", "reset_gpu", extra="\n    priority: 100"),
        rule("reboot", "{kinds: [nccl_timeout]}", "reboot", extra="\n    priority: -5"),
    )
    decision = decide(p, NCCL)
    assert (decision.rule, decision.action) == ("reboot", Action.REBOOT)
    assert decision.matched == ["reboot", "reset"]


def test_priority_beats_file_order():
    p = policy(
        rule("first", "{kinds: [nccl_timeout]}", "reboot", extra="\n    priority: 1"),
        rule("second", "{kinds: [nccl_timeout]}", "reboot", extra="\n    priority: 2"),
    )
    assert decide(p, NCCL).matched == ["second", "first"]


@pytest.mark.parametrize("order", [("a", "b", "c"), ("c", "b", "a"), ("b", "c", "a")])
def test_file_order_breaks_remaining_ties(order):
    p = policy(*(rule(name, "{kinds: [nccl_timeout]}", "reboot") for name in order))
    decision = decide(p, NCCL)
    assert decision.rule == order[0]
    assert decision.matched == list(order)


def test_overrides_among_themselves_follow_rank_then_priority():
    p = policy(
        rule("esc", "{kinds: [nccl_timeout]}", "escalate", extra="\n    override: true\n    priority: 9"),
        rule("rep", "{kinds: [nccl_timeout]}", "replace", extra="\n    override: true"),
        rule("plain", "{kinds: [nccl_timeout]}", "replace", extra="\n    priority: 99"),
    )
    assert decide(p, NCCL).matched == ["rep", "esc", "plain"]


def test_every_action_rank_in_order():
    by_rank_low_first = sorted(Action, key=ACTION_RANK.__getitem__)
    p = policy(
        *(rule(f"r-{a.value.replace('_', '-')}", "{kinds: [nccl_timeout]}", a) for a in by_rank_low_first)
    )
    decision = decide(p, NCCL)
    assert decision.matched == [f"r-{a.value.replace('_', '-')}" for a in reversed(by_rank_low_first)]
    assert decision.action is Action.REPLACE
    assert list(reversed(by_rank_low_first))[:4] == [
        Action.REPLACE,
        Action.REBOOT,
        Action.RESET_GPU,
        Action.DIAGNOSE,
    ]


# --- Default decision -----------------------------------------------------------------------


def test_default_decision_when_nothing_matches():
    p = policy(
        rule("xid", "{xid: [79]}", "reboot"),
        defaults="defaults:\n  classification: software\n  action: escalate",
    )
    decision = decide(p, NCCL, SHA)
    assert decision.rule == "default"
    assert decision.action is Action.ESCALATE
    assert decision.classification == "software"
    assert decision.matched == []
    assert decision.diagnose_level is None
    assert decision.policy_sha256 == SHA
    assert decision.incident == NCCL.incident
    assert "no rule matched" in decision.reason


def test_builtin_defaults_are_unknown_and_none():
    decision = decide(policy(rule("xid", "{xid: [79]}", "reboot")), NCCL)
    assert (decision.rule, decision.classification, decision.action) == ("default", "unknown", "none")


# --- Conditions -----------------------------------------------------------------------------


def test_all_conditions_must_hold():
    p = policy(rule("both", "{kinds: [nccl_timeout], xid: [79]}", "reboot"))
    assert decide(p, NCCL).rule == "default"
    assert decide(p, facts(event("nccl_timeout"), event("xid", code=79))).rule == "both"


def test_not_kinds_blocks_a_rule():
    p = policy(rule("app", "{kinds: [nan_loss], not_kinds: [xid]}", "none"))
    assert decide(p, facts(event("nan_loss"))).rule == "app"
    assert decide(p, facts(event("nan_loss"), event("xid", code=13))).rule == "default"


def test_dcgm_errors_match_by_name_whatever_the_event_used():
    p = policy(rule("mem", "{dcgm_errors: [DCGM_FR_FAULTY_MEMORY]}", "replace"))
    for error_id in ("DCGM_FR_FAULTY_MEMORY", 52, "52"):
        assert decide(p, facts(event("dcgm_health", error_id=error_id))).rule == "mem"
    assert decide(p, facts(event("dcgm_health", error_id="DCGM_FR_NVLINK_DOWN"))).rule == "default"


def test_straggler_thresholds():
    p = policy(rule("slow", "{straggler: {ratio_at_least: 1.5, reports_at_least: 2}}", "drain"))
    slow = [event("straggler", minutes=m, step_time_ratio=r) for m, r in ((0, 1.1), (1, 1.6))]
    assert decide(p, facts(*slow)).rule == "slow"
    assert decide(p, facts(slow[1])).rule == "default"
    assert decide(p, facts(*(event("straggler", minutes=m, step_time_ratio=1.4) for m in range(5)))).rule == (
        "default"
    )


def test_recent_remediations_window():
    p = policy(
        rule("busy", "{recent_remediations_at_least: 2, kinds: [xid]}", "escalate"),
        rule("quiet", "{recent_remediations_at_most: 1, kinds: [xid]}", "none"),
    )

    def with_history(*days_ago: float) -> Facts:
        history = [event("remediation", minutes=-d * 1440, action="reboot") for d in days_ago]
        return facts(*history, event("xid", code=79))

    assert decide(p, with_history()).rule == "quiet"
    assert decide(p, with_history(1)).rule == "quiet"
    assert decide(p, with_history(1, 6.9)).rule == "busy"
    assert decide(p, with_history(1, 7.5)).rule == "quiet"  # older than 7 days: forgotten


def test_at_least_and_at_most_on_one_count_give_one_reason():
    p = policy(rule("r", "{recent_remediations_at_least: 1, recent_remediations_at_most: 3}", "drain"))
    f = facts(event("remediation", minutes=-60, action="reboot"), event("xid", code=79))
    assert decide(p, f).reason == "Rule r: 1 remediations on this node in 7 days"


# --- Diagnose levels ------------------------------------------------------------------------


def test_diagnose_rule_stops_matching_once_its_level_ran():
    p = policy(
        rule("diag2", "{kinds: [nccl_timeout]}", "diagnose", then="\n      diagnose_level: 2"),
        rule("fallback", "{kinds: [nccl_timeout]}", "escalate"),
    )
    first = decide(p, NCCL)
    assert (first.rule, first.action, first.diagnose_level) == ("diag2", Action.DIAGNOSE, 2)
    assert first.matched == ["diag2", "fallback"]

    after_level_1 = decide(p, facts(event("nccl_timeout"), diag(1, "pass")))
    assert (after_level_1.rule, after_level_1.diagnose_level) == ("diag2", 2)

    for ran in (2, 3):
        satisfied = decide(p, facts(event("nccl_timeout"), diag(ran, "pass")))
        assert satisfied.rule == "fallback"
        assert satisfied.matched == ["fallback"]


def test_next_climbs_one_level_at_a_time_then_escalates_after_4():
    p = policy(rule("climb", "{kinds: [nccl_timeout]}", "diagnose", then="\n      diagnose_level: next"))
    events = [event("nccl_timeout")]
    for expected in (1, 2, 3, 4):
        decision = decide(p, facts(*events))
        assert (decision.action, decision.diagnose_level) == (Action.DIAGNOSE, expected)
        events.append(diag(expected, "fail", "DCGM_FR_NVLINK_DOWN"))
    exhausted = decide(p, facts(*events), SHA)
    assert exhausted.action is Action.ESCALATE
    assert exhausted.diagnose_level is None
    assert exhausted.rule == "climb"
    assert exhausted.classification == "hardware"
    assert "diagnostics exhausted at level 4" in exhausted.reason
    assert exhausted.policy_sha256 == SHA


def test_next_climbs_from_the_highest_level_run():
    p = policy(rule("climb", "{kinds: [nccl_timeout]}", "diagnose", then="\n      diagnose_level: next"))
    decision = decide(p, facts(event("nccl_timeout"), diag(3, "fail"), diag(1, "fail", minutes=10)))
    assert decision.diagnose_level == 4


def test_max_diagnose_level_caps_the_climb():
    p = policy(
        rule("climb", "{kinds: [nccl_timeout]}", "diagnose", then="\n      diagnose_level: next"),
        defaults="defaults:\n  max_diagnose_level: 2",
    )
    assert decide(p, facts(event("nccl_timeout"), diag(1, "fail"))).diagnose_level == 2
    capped = decide(p, facts(event("nccl_timeout"), diag(1, "fail"), diag(2, "fail")))
    assert capped.action is Action.ESCALATE
    assert "exhausted at level 2" in capped.reason


def test_fixed_level_above_the_cap_escalates():
    p = policy(
        rule("deep", "{kinds: [nccl_timeout]}", "diagnose", then="\n      diagnose_level: 3"),
        defaults="defaults:\n  max_diagnose_level: 2",
    )
    assert decide(p, NCCL).action is Action.ESCALATE


def test_diagnostic_condition_on_the_latest_run():
    p = policy(
        rule(
            "isolate", "{diagnostic: {result: fail, worst_severity: [ISOLATE], level_at_least: 2}}", "replace"
        ),
        rule("passed", "{diagnostic: {result: pass}}", "none"),
    )
    failed_2 = facts(diag(2, "fail", "DCGM_FR_NVLINK_DOWN", "DCGM_FR_FAULTY_MEMORY"))
    assert decide(p, failed_2).rule == "isolate"
    assert decide(p, facts(diag(1, "fail", 52))).rule == "default"  # level 1 < level_at_least
    # The latest run decides: an earlier failure followed by a pass is a pass.
    assert decide(p, facts(diag(2, "fail", 52), diag(3, "pass"))).rule == "passed"


# --- What a decision records ----------------------------------------------------------------


def test_decision_records_sha_rule_reason_and_then():
    p = policy(
        rule(
            "fell-off",
            "{xid: [79], not_kinds: [diagnostic], min_events: 2}",
            "reboot",
            then='\n      recommend: ["restart the job"]',
        )
    )
    f = facts(event("xid", code=79), event("xid", minutes=1, code=13))
    decision = decide(p, f, SHA)
    assert decision.policy_sha256 == SHA
    assert decision.rule == "fell-off"
    assert decision.incident == f.incident
    assert decision.reason == "Rule fell-off: XID 79; 2 events; no diagnostic"
    assert decision.recommend == ["restart the job"]
    assert decision.diagnose_level is None


@pytest.mark.parametrize(
    ("when", "events", "out_of_service", "says"),
    [
        ("{kinds: [nccl_timeout, xid]}", [event("nccl_timeout")], False, "kind nccl_timeout"),
        (
            "{dcgm_errors: [DCGM_FR_FAULTY_MEMORY]}",
            [event("dcgm_health", error_id=52)],
            False,
            "DCGM_FR_FAULTY_MEMORY",
        ),
        ("{dcgm_severity: [ISOLATE]}", [event("dcgm_health", error_id=52)], False, "severity ISOLATE"),
        (
            "{ecc_dbe_at_least: 1}",
            [event("ecc", dbe=2), event("ecc", minutes=1, dbe=1)],
            False,
            "3 double-bit ECC",
        ),
        (
            "{straggler: {}}",
            [event("straggler", minutes=m, step_time_ratio=1.5) for m in range(3)],
            False,
            "3 straggler reports, step time up to 1.5x",
        ),
        (
            "{diagnostic: {result: fail}}",
            [diag(2, "fail", 52)],
            False,
            "DCGM level 2 fail (DCGM_FR_FAULTY_MEMORY)",
        ),
        (
            "{out_of_service: true, kinds: [nccl_timeout]}",
            [event("nccl_timeout")],
            True,
            "node out of service",
        ),
        ("{out_of_service: false, kinds: [nccl_timeout]}", [event("nccl_timeout")], False, "node in service"),
    ],
)
def test_reason_names_the_facts(when, events, out_of_service, says):
    decision = decide(policy(rule("r", when, "drain")), facts(*events, out_of_service=out_of_service))
    assert decision.rule == "r"
    assert decision.reason.startswith("Rule r: ")
    assert says in decision.reason


def test_matched_lists_every_matching_rule_winner_first():
    p = policy(
        rule("no-match", "{xid: [79]}", "replace"),
        rule("low", "{kinds: [nccl_timeout]}", "none"),
        rule("high", "{kinds: [nccl_timeout]}", "reboot"),
        rule("mid", "{kinds: [nccl_timeout]}", "diagnose"),
    )
    decision = decide(p, NCCL)
    assert decision.matched == ["high", "mid", "low"]
    assert decision.matched[0] == decision.rule


def test_decide_is_deterministic():
    p = policy(rule("a", "{kinds: [nccl_timeout]}", "reboot"), rule("b", "{kinds: [nccl_timeout]}", "reboot"))
    assert decide(p, NCCL, SHA) == decide(p, NCCL, SHA)
