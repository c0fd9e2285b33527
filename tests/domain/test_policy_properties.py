"""Property tests: random event streams through correlate -> facts_of -> decide."""

from __future__ import annotations

from datetime import timedelta

from checkout import REPO_ROOT
from factories import fault_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medic import dcgm_errors
from medic.events import EventKind, FaultEvent
from medic.facts import Facts, facts_of
from medic.incidents import correlate
from medic.policy import Action, Decision, Policy, decide, load_policy
from medic.policy.engine import match
from medic.policy.model import ACTION_RANK, Rule

DEFAULT = load_policy(REPO_ROOT / "policies" / "default.yaml")
FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

KNOWN_DCGM = [e.name for e in dcgm_errors.all_errors()] + [e.id for e in dcgm_errors.all_errors()]
dcgm_error_ids = st.one_of(
    st.sampled_from(KNOWN_DCGM),
    st.integers(0, 500),
    st.sampled_from(["DCGM_FR_NOT_A_THING", "52", "9999"]),
)
xid_codes = st.one_of(
    st.sampled_from([13, 31, 43, 48, 62, 64, 79, 94, 95, 109, 119, 120, 136, 140, 143]),
    st.integers(1, 1000),
)
empty = st.just({})

ATTRIBUTES: dict[EventKind, st.SearchStrategy[dict]] = {
    EventKind.XID: st.fixed_dictionaries({"code": xid_codes}),
    EventKind.DCGM_HEALTH: st.fixed_dictionaries({"error_id": dcgm_error_ids}),
    EventKind.ECC: st.fixed_dictionaries({}, optional={"dbe": st.integers(0, 3), "sbe": st.integers(0, 50)}),
    EventKind.NCCL_TIMEOUT: empty,
    EventKind.NAN_LOSS: empty,
    EventKind.STRAGGLER: st.fixed_dictionaries({"step_time_ratio": st.floats(0.5, 3.0)}),
    EventKind.THERMAL: st.fixed_dictionaries({}, optional={"temperature_c": st.floats(20, 110)}),
    EventKind.GPU_MISSING: st.integers(1, 8).flatmap(
        lambda n: st.fixed_dictionaries({"expected": st.just(n), "found": st.integers(0, n - 1)})
    ),
    EventKind.NODE_UNREACHABLE: empty,
    EventKind.JOB_CRASH: st.fixed_dictionaries({"exit_code": st.integers(-9, 255)}),
    EventKind.HEALTH_CHECK: st.fixed_dictionaries(
        {"phase": st.sampled_from(["prolog", "epilog", "healthcheck"])},
        optional={"check": st.text(max_size=5)},
    ),
    EventKind.DIAGNOSTIC: st.fixed_dictionaries(
        {
            "level": st.integers(1, 4),
            "result": st.sampled_from(["pass", "fail"]),
            "error_ids": st.lists(dcgm_error_ids, max_size=3),
        }
    ),
    EventKind.REMEDIATION: st.fixed_dictionaries({"action": st.sampled_from([a.value for a in Action])}),
    EventKind.NODE_STATE: st.fixed_dictionaries({"change": st.sampled_from(["drain", "resume", "reboot"])}),
}
assert set(ATTRIBUTES) == set(EventKind), "every event kind has a strategy"


@st.composite
def fault_events(draw: st.DrawFn) -> FaultEvent:
    kind = draw(st.sampled_from(list(EventKind)))
    return fault_event(
        kind,
        id=f"e{draw(st.integers(0, 10**6))}",
        # Minutes over ~10 days: bursts inside one window and history across the 7-day horizon.
        minutes=draw(st.one_of(st.integers(0, 30), st.integers(0, 14_400))),
        source="prop",
        node=draw(st.sampled_from(["n1", "n2", "n3"])),
        gpu=draw(st.none() | st.integers(0, 7)),
        job=draw(st.none() | st.sampled_from(["j1", "j2"])),
        attributes=draw(ATTRIBUTES[kind]),
    )


event_streams = st.lists(fault_events(), min_size=1, max_size=25)


def precedence(policy: Policy, rule: Rule) -> tuple[bool, int, int, int]:
    """Recomputed from docs/policy.md: override, action rank, priority, earlier in the file."""
    return (rule.override, ACTION_RANK[rule.then.action], rule.priority, -policy.rules.index(rule))


def satisfied(rule: Rule, facts: Facts) -> bool:
    """A diagnose rule whose level has already run for the incident no longer applies."""
    if rule.then.action is not Action.DIAGNOSE or rule.then.diagnose_level == "next":
        return False
    return facts.highest_level_run >= int(rule.then.diagnose_level or 1)


def check_decision(policy: Policy, facts: Facts, decision: Decision, sha: str) -> None:
    by_id = {r.id: r for r in policy.rules}
    expected = {r.id for r in policy.rules if match(r, facts) is not None and not satisfied(r, facts)}
    assert set(decision.matched) == expected
    assert len(decision.matched) == len(expected)
    assert decision.policy_sha256 == sha
    assert decision.incident == facts.incident
    if not expected:
        assert decision.rule == "default"
        assert decision.action is policy.defaults.action
        return
    keys = [precedence(policy, by_id[rule_id]) for rule_id in decision.matched]
    assert decision.rule == decision.matched[0]
    assert keys[0] == max(keys)
    assert keys == sorted(keys, reverse=True)
    winner = by_id[decision.rule]
    assert decision.reason.startswith(winner.description)
    if winner.then.action is Action.DIAGNOSE:
        if decision.action is Action.ESCALATE:
            assert "exhausted" in decision.reason
        else:
            assert decision.action is Action.DIAGNOSE
            assert decision.diagnose_level is not None
            assert facts.highest_level_run < decision.diagnose_level <= policy.defaults.max_diagnose_level
    else:
        assert decision.action is winner.then.action
        assert decision.diagnose_level is None


@FAST
@given(events=event_streams, out_of_service=st.booleans(), late=st.integers(0, 20_000))
def test_default_policy_never_crashes_and_picks_the_top_rule(events, out_of_service, late):
    incidents = correlate(events)
    assert sum(len(i.events) for i in incidents) == sum(
        e.kind not in (EventKind.REMEDIATION, EventKind.NODE_STATE) for e in events
    )
    for incident in incidents:
        for now in (None, incident.last_at + timedelta(minutes=late)):
            facts = facts_of(incident, out_of_service=out_of_service, now=now)
            decision = decide(DEFAULT.policy, facts, DEFAULT.sha256)
            check_decision(DEFAULT.policy, facts, decision, DEFAULT.sha256)


# Random small policies exercise the tie-breaks the default policy rarely reaches.
random_rules = st.lists(
    st.fixed_dictionaries(
        {
            "kinds": st.lists(st.sampled_from([k.value for k in EventKind]), min_size=1, max_size=3),
            "action": st.sampled_from([a.value for a in Action]),
            "priority": st.integers(-2, 2),
            "override": st.booleans(),
            "level": st.sampled_from([1, 2, 3, 4, "next"]),
        }
    ),
    min_size=1,
    max_size=8,
)


def build_policy(specs: list[dict], max_level: int) -> Policy:
    rules = []
    for n, spec in enumerate(specs):
        then = {"classification": "hardware", "action": spec["action"]}
        if spec["action"] == "diagnose":
            then["diagnose_level"] = spec["level"]
        rules.append(
            {
                "id": f"r{n}",
                "description": f"rule {n}",
                "priority": spec["priority"],
                "override": spec["override"],
                "when": {"kinds": spec["kinds"]},
                "then": then,
            }
        )
    return Policy.model_validate({"defaults": {"max_diagnose_level": max_level}, "rules": rules})


@FAST
@given(specs=random_rules, events=event_streams, max_level=st.integers(1, 4))
def test_random_policies_pick_the_top_rule(specs, events, max_level):
    policy = build_policy(specs, max_level)
    for incident in correlate(events):
        facts = facts_of(incident)
        check_decision(policy, facts, decide(policy, facts, "sha"), "sha")
