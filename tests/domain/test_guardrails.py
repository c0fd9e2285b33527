"""Guardrails: the pure checks in medic.policy.guardrails, then the default policy's through triage."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from checkout import REPO_ROOT
from factories import T0, fault_event

from medic.events import FaultEvent
from medic.policy import Action, Classification, Decision, load_policy
from medic.policy.guardrails import FleetState, apply, breaker_trips, check, takes_node_out
from medic.policy.model import CircuitBreaker, Guardrails, Policy
from medic.triage import triage

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"
OUT = [Action.DRAIN, Action.RESET_GPU, Action.REBOOT, Action.REPLACE]


def ago(minutes: float) -> datetime:
    return T0 - timedelta(minutes=minutes)


def wants(action: Action, level: int | None = None) -> Decision:
    return Decision(
        incident="inc-1",
        classification=Classification.HARDWARE,
        action=action,
        diagnose_level=level,
        rule="r",
        reason="rule r",
    )


def fleet(**fields: Any) -> FleetState:
    return FleetState(now=T0, **fields)


def stopped_by(rails: Guardrails, state: FleetState, decision: Decision, node: str = "n1") -> str | None:
    found = check(rails, state, node, decision)
    return found[0] if found else None


# --- What takes a node out --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("decision", "out"),
    [
        (wants(Action.DIAGNOSE, 1), False),  # level 1 runs beside the job
        (wants(Action.DIAGNOSE, 2), True),  # levels 2-4 need idle GPUs: drained
        (wants(Action.DIAGNOSE, 4), True),
        (wants(Action.DRAIN), True),
        (wants(Action.RESET_GPU), True),
        (wants(Action.REBOOT), True),
        (wants(Action.REPLACE), True),
        (wants(Action.REINTEGRATE), False),
        (wants(Action.ESCALATE), False),
        (wants(Action.NONE), False),
    ],
)
def test_takes_node_out(decision: Decision, out: bool) -> None:
    assert takes_node_out(decision) is out


# --- max_out_of_service -----------------------------------------------------------------------


def test_max_out_of_service_counts_nodes_already_out() -> None:
    rails = Guardrails(max_out_of_service=2)
    two_out = fleet(out_of_service=frozenset({"n2", "n3"}))
    assert stopped_by(rails, two_out, wants(Action.REBOOT)) == "max_out_of_service"
    assert stopped_by(rails, two_out, wants(Action.DIAGNOSE, 2)) == "max_out_of_service"
    assert stopped_by(rails, fleet(out_of_service=frozenset({"n2"})), wants(Action.REBOOT)) is None
    # Not out of service: nothing to limit.
    assert stopped_by(rails, two_out, wants(Action.DIAGNOSE, 1)) is None
    assert stopped_by(rails, two_out, wants(Action.REINTEGRATE)) is None
    _, why = check(rails, two_out, "n1", wants(Action.DRAIN)) or ("", "")
    assert why == "2 nodes already out of service (limit 2)"


def test_a_node_already_out_does_not_count_twice() -> None:
    rails = Guardrails(max_out_of_service=2)
    state = fleet(out_of_service=frozenset({"n1", "n2"}))
    # n1 is drained for diagnostics; rebooting it takes nothing more out of the fleet.
    assert stopped_by(rails, state, wants(Action.REBOOT), node="n1") is None
    assert stopped_by(rails, state, wants(Action.REBOOT), node="n3") == "max_out_of_service"


@pytest.mark.parametrize(
    ("fleet_size", "percent", "limit"),
    [
        (8, 10, 1),  # 0.8 rounds up: a small fleet can still fix one node
        (3, 1, 1),
        (10, 10, 1),
        (11, 10, 2),
        (100, 10, 10),
        (100, 12.5, 13),
    ],
)
def test_percent_of_the_fleet_rounds_up(fleet_size: int, percent: float, limit: int) -> None:
    rails = Guardrails(max_out_of_service_percent=percent)
    out = frozenset(f"x{k}" for k in range(limit))
    just_below = frozenset(f"x{k}" for k in range(limit - 1))
    assert (
        stopped_by(rails, fleet(fleet_size=fleet_size, out_of_service=just_below), wants(Action.DRAIN))
        is None
    )
    assert (
        stopped_by(rails, fleet(fleet_size=fleet_size, out_of_service=out), wants(Action.DRAIN))
        == "max_out_of_service"
    )


def test_without_a_fleet_size_only_count_limits_apply() -> None:
    many_out = frozenset(f"x{k}" for k in range(50))
    assert (
        stopped_by(
            Guardrails(max_out_of_service_percent=10), fleet(out_of_service=many_out), wants(Action.REBOOT)
        )
        is None
    )
    both = Guardrails(max_out_of_service=3, max_out_of_service_percent=50)
    three_out = frozenset({"x1", "x2", "x3"})
    assert stopped_by(both, fleet(out_of_service=three_out), wants(Action.REBOOT)) == "max_out_of_service"
    # With the size known, the lower of the two limits holds: 50% of 100 would allow 50.
    assert stopped_by(both, fleet(fleet_size=100, out_of_service=three_out), wants(Action.REBOOT)) == (
        "max_out_of_service"
    )
    # ... and 50% of 4 (2) is lower than 3.
    two_out = frozenset({"x1", "x2"})
    assert stopped_by(both, fleet(fleet_size=4, out_of_service=two_out), wants(Action.REBOOT)) == (
        "max_out_of_service"
    )


# --- max_destructive_per_hour and node_cooldown_minutes -----------------------------------------


def test_destructive_actions_per_hour() -> None:
    rails = Guardrails(max_destructive_per_hour=3)
    three = fleet(destructive_at=(ago(5), ago(30), ago(59)))
    for action in (Action.RESET_GPU, Action.REBOOT, Action.REPLACE):
        assert stopped_by(rails, three, wants(action)) == "max_destructive_per_hour"
    # A drain or a diagnostic is not destructive.
    assert stopped_by(rails, three, wants(Action.DRAIN)) is None
    assert stopped_by(rails, three, wants(Action.DIAGNOSE, 3)) is None
    # One of the three is more than an hour old.
    assert stopped_by(rails, fleet(destructive_at=(ago(5), ago(30), ago(61))), wants(Action.REBOOT)) is None


def test_node_cooldown() -> None:
    rails = Guardrails(node_cooldown_minutes=30)
    state = fleet(last_destructive={"n1": ago(10), "n2": ago(31)})
    assert stopped_by(rails, state, wants(Action.REBOOT), node="n1") == "node_cooldown"
    assert stopped_by(rails, state, wants(Action.REBOOT), node="n2") is None
    assert stopped_by(rails, state, wants(Action.REBOOT), node="n3") is None
    assert stopped_by(rails, state, wants(Action.DRAIN), node="n1") is None
    assert check(rails, state, "n1", wants(Action.REPLACE)) == (
        "node_cooldown",
        "n1 was acted on 10 min ago (cooldown 30 min)",
    )


# --- never_touch ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("node", "touched"),
    [
        ("gpu-node-1", True),
        ("gpu-node-17", True),
        ("gpu-node-2", False),
        ("GPU-NODE-1", False),  # patterns are case-sensitive, like node names
        ("login-a", True),
        ("login-ab", False),
        ("head", True),
        ("head-2", False),
    ],
)
def test_never_touch_patterns(node: str, touched: bool) -> None:
    rails = Guardrails(never_touch=["gpu-node-1*", "login-?", "head"])
    for decision in (
        wants(Action.REBOOT),
        wants(Action.DRAIN),
        wants(Action.DIAGNOSE, 2),
        wants(Action.REINTEGRATE),
    ):
        assert (stopped_by(rails, fleet(), decision, node=node) == "never_touch") is touched
    # Recording, telling a human and a diagnostic beside the job touch nothing.
    for decision in (wants(Action.NONE), wants(Action.ESCALATE), wants(Action.DIAGNOSE, 1)):
        assert stopped_by(rails, fleet(), decision, node=node) is None


# --- The circuit breaker ------------------------------------------------------------------


@pytest.mark.parametrize("action", OUT)
def test_an_open_breaker_stops_taking_nodes_out(action: Action) -> None:
    rails = Guardrails()  # even without a circuit_breaker block: the store's breaker is open
    assert stopped_by(rails, fleet(breaker_open=True), wants(action)) == "circuit_breaker"


def test_an_open_breaker_still_lets_nodes_return() -> None:
    rails = Guardrails(circuit_breaker=CircuitBreaker(nodes_at_least=1))
    state = fleet(breaker_open=True, taken_out_at={"n1": ago(1), "n2": ago(1)})
    assert check(rails, state, "n1", wants(Action.REINTEGRATE)) is None
    assert stopped_by(rails, state, wants(Action.DIAGNOSE, 1)) is None
    assert stopped_by(rails, state, wants(Action.DIAGNOSE, 2)) == "circuit_breaker"
    # ... unless the node is never to be touched at all.
    never = Guardrails(never_touch=["n1"])
    assert stopped_by(never, fleet(breaker_open=True), wants(Action.REINTEGRATE)) == "never_touch"


def test_breaker_counts_nodes_taken_out_within_the_window_even_if_back() -> None:
    rails = Guardrails(circuit_breaker=CircuitBreaker(nodes_at_least=2, window_minutes=5))
    # n2 and n3 went out 1 and 4 minutes ago; both are back (not out_of_service any more).
    state = fleet(taken_out_at={"n2": ago(1), "n3": ago(4), "n4": ago(6)})
    assert breaker_trips(rails, state, "n1") == "3 nodes taken out within 5 min (limit 2)"
    assert stopped_by(rails, state, wants(Action.DRAIN)) == "circuit_breaker"
    # Taking n2 out again is no new node.
    assert breaker_trips(rails, state, "n2") is None
    # n4 went out 6 minutes ago: outside the window.
    assert breaker_trips(rails, fleet(taken_out_at={"n3": ago(4), "n4": ago(6)}), "n1") is None


def test_breaker_percent_rounds_up_and_needs_the_fleet_size() -> None:
    rails = Guardrails(circuit_breaker=CircuitBreaker(nodes_percent=25, window_minutes=5))
    two_out = {"n2": ago(1), "n3": ago(2)}
    assert breaker_trips(rails, fleet(fleet_size=8, taken_out_at=two_out), "n1") == (
        "3 nodes taken out within 5 min (limit 2)"
    )
    assert breaker_trips(rails, fleet(fleet_size=9, taken_out_at=two_out), "n1") is None  # 2.25 -> 3
    assert breaker_trips(rails, fleet(taken_out_at=two_out), "n1") is None
    assert breaker_trips(Guardrails(), fleet(fleet_size=8, taken_out_at=two_out), "n1") is None


def test_the_breaker_is_checked_before_the_other_limits() -> None:
    rails = Guardrails(max_out_of_service=1, circuit_breaker=CircuitBreaker(nodes_at_least=1))
    state = fleet(out_of_service=frozenset({"n2"}), taken_out_at={"n2": ago(1)})
    assert stopped_by(rails, state, wants(Action.REBOOT)) == "circuit_breaker"


# --- apply ----------------------------------------------------------------------------------


def test_apply_turns_a_stopped_action_into_escalate() -> None:
    asked = wants(Action.DIAGNOSE, 3)
    result = apply(Guardrails(max_out_of_service=1), fleet(out_of_service=frozenset({"n9"})), "n1", asked)
    assert result.action is Action.ESCALATE
    assert result.diagnose_level is None
    assert (result.guardrail, result.blocked_action) == ("max_out_of_service", Action.DIAGNOSE)
    assert result.reason == (
        "rule r; diagnose stopped by guardrail max_out_of_service: 1 nodes already out of service (limit 1)"
    )
    assert (result.rule, result.classification, result.incident) == ("r", asked.classification, "inc-1")


def test_apply_leaves_an_allowed_decision_alone() -> None:
    asked = wants(Action.REBOOT)
    assert apply(Guardrails(max_out_of_service=5), fleet(), "n1", asked) is asked


# --- The default policy through `medic triage` ------------------------------------------------


def event(kind: str, node: str, minutes: float, **fields: Any) -> FaultEvent:
    return fault_event(kind, node=node, minutes=minutes, **fields)


def xid(code: int, node: str, minutes: float, gpu: int = 0) -> FaultEvent:
    return event("xid", node, minutes, gpu=gpu, attributes={"code": code})


@pytest.fixture(scope="module")
def loaded():
    return load_policy(DEFAULT_POLICY)


def run(loaded, events: list[FaultEvent], fleet_size: int | None = None) -> list[tuple[str, Decision]]:
    return [(incident.node, decision) for incident, decision in triage(events, loaded, fleet_size)]


def summary(decision: Decision) -> tuple[str, str, int | None, str, str | None]:
    return (
        decision.classification.value,
        decision.action.value,
        decision.diagnose_level,
        decision.rule,
        decision.guardrail,
    )


def test_xid79_on_three_of_eight_nodes_opens_the_breaker_and_it_stays_open(loaded) -> None:
    events = [
        xid(79, "n1", 0),
        xid(79, "n2", 1),
        xid(79, "n3", 3),
        xid(79, "n4", 120),  # two hours later: the breaker is still open
        event("nccl_timeout", "n5", 130),  # a level-1 diagnostic takes nothing out
    ]
    results = run(loaded, events, fleet_size=8)
    assert [(node, d.action.value, d.guardrail) for node, d in results] == [
        ("n1", "reboot", None),
        ("n2", "reboot", None),
        ("n3", "escalate", "circuit_breaker"),
        ("n4", "escalate", "circuit_breaker"),
        ("n5", "diagnose", None),
    ]
    third = results[2][1]
    assert third.blocked_action is Action.REBOOT
    assert third.rule == "xid-fallen-off-bus"
    assert "3 nodes taken out within 5 min (limit 2)" in third.reason
    assert "the circuit breaker is open; a human must close it" in results[3][1].reason


def test_without_fleet_size_only_count_limits_apply(loaded) -> None:
    first = [xid(79, "n1", 0), xid(79, "n2", 1), xid(79, "n3", 3)]
    assert [d.action for _, d in run(loaded, first)] == [Action.REBOOT] * 3
    # max_destructive_per_hour (20) is a count: it holds without the fleet size.
    reboots = [xid(79, f"n{k}", k * 2) for k in range(21)]
    results = run(loaded, reboots)
    assert [d.action for _, d in results[:20]] == [Action.REBOOT] * 20
    assert (results[20][1].action, results[20][1].guardrail) == (Action.ESCALATE, "max_destructive_per_hour")


def test_replayed_fleet_keeps_drained_nodes_out_and_returns_repaired_ones(loaded) -> None:
    isolate = "DCGM_FR_VOLATILE_DBE_DETECTED"  # ISOLATE: diagnose level 2, the node is drained
    health = [
        event("dcgm_health", node, m, gpu=0, attributes={"error_id": isolate})
        for node, m in (("n1", 0), ("n2", 30))
    ]
    # 10% of 8 nodes is 1: n1 is still out for its diagnostic, so n2's cannot start.
    assert [summary(d) for _, d in run(loaded, health, fleet_size=8)] == [
        ("hardware", "diagnose", 2, "dcgm-health-isolate", None),
        ("hardware", "escalate", None, "dcgm-health-isolate", "max_out_of_service"),
    ]
    # A reboot returns the node once verified, so the next one may go out.
    rebooted = [xid(79, "n1", 0), health[1]]
    assert [summary(d) for _, d in run(loaded, rebooted, fleet_size=8)] == [
        ("hardware", "reboot", None, "xid-fallen-off-bus", None),
        ("hardware", "diagnose", 2, "dcgm-health-isolate", None),
    ]


def test_cooldown_stops_a_second_reboot_of_one_node(loaded) -> None:
    results = run(loaded, [xid(79, "n1", 0), xid(79, "n1", 20), xid(79, "n1", 60)])
    assert [(d.action.value, d.guardrail) for _, d in results] == [
        ("reboot", None),
        ("escalate", "node_cooldown"),
        ("reboot", None),
    ]


# --- The default policy's correlation rules through triage ---------------------------------


def timeout(node: str, minutes: float, switch: str = "leaf-1") -> FaultEvent:
    return event("nccl_timeout", node, minutes, switch=switch)


def test_a_switch_storm_is_the_networks(loaded) -> None:
    storm = [timeout(f"n{k}", 2) for k in range(1, 5)]
    lone = timeout("n9", 3, switch="leaf-2")
    results = list(triage([*storm, lone], loaded, fleet_size=8))
    # One incident about the switch, not four about its nodes; the lone timeout stays its node's.
    assert [(i.scope, i.node, i.nodes, summary(d), d.owner) for i, d in results] == [
        (
            "switch",
            "leaf-1",
            ["n1", "n2", "n3", "n4"],
            ("infrastructure", "escalate", None, "network-switch-storm", None),
            "network",
        ),
        ("node", "n9", ["n9"], ("unknown", "diagnose", 1, "lone-nccl-timeout", None), None),
    ]


def test_no_rule_can_act_on_nodes_of_a_switch_incident(loaded) -> None:
    """Even a policy that asks to reboot on a storm gets an escalation: never 32 reboots."""
    data = loaded.policy.model_dump(mode="json")
    next(r for r in data["rules"] if r["id"] == "network-switch-storm")["then"]["action"] = "reboot"
    unsafe = replace(loaded, policy=Policy.model_validate(data))
    ((incident, decision),) = triage([timeout(f"n{k}", 2) for k in range(1, 6)], unsafe, fleet_size=8)
    assert incident.scope == "switch"
    assert (decision.action, decision.blocked_action, decision.guardrail) == (
        Action.ESCALATE,
        Action.REBOOT,
        "switch_incident",
    )


def test_a_storm_spread_over_minutes_is_still_one_incident(loaded) -> None:
    # Correlation sees the whole burst, so the first node to report is not decided on alone.
    spread = [timeout(f"n{k}", k) for k in range(1, 5)]
    ((switch, decision),) = run(loaded, spread)
    assert (switch, decision.rule) == ("leaf-1", "network-switch-storm")
    assert "4 nodes under leaf-1 report nccl_timeout within 5 min" in decision.reason
    # Four nodes over more than five minutes are no storm.
    slow = [timeout(f"n{k}", k * 2) for k in range(1, 5)]
    assert {d.rule for _, d in run(loaded, slow)} == {"lone-nccl-timeout"}


def nan_loss(node: str, minutes: float, gpu: int = 0, job: str = "llm", **fields: Any) -> FaultEvent:
    return event("nan_loss", node, minutes, gpu=gpu, job=job, **fields)


def test_the_same_nan_at_the_same_step_on_two_nodes_is_software(loaded) -> None:
    same = [nan_loss("n1", 0, iteration=4200, rank=7), nan_loss("n2", 0, iteration=4200, rank=7)]
    assert [summary(d) for _, d in run(loaded, same)] == [
        ("software", "none", None, "application-same-step-many-nodes", None)
    ] * 2


def test_the_same_step_wins_over_a_gpu_that_repeats(loaded) -> None:
    # n1's GPU 0 has failed three times, but n2 failed at the very same step: the application.
    earlier = [nan_loss("n1", -240), nan_loss("n1", -120)]
    same = [nan_loss("n1", 0, iteration=4200, rank=7), nan_loss("n2", 0, iteration=4200, rank=7)]
    results = dict(run(loaded, [*earlier, *same]))
    assert summary(results["n1"]) == ("software", "none", None, "application-same-step-many-nodes", None)
    assert "application-signature-repeats-on-gpu" in results["n1"].matched


def test_nan_on_one_gpu_in_three_bursts_is_the_gpu(loaded) -> None:
    bursts = [nan_loss("n1", minutes) for minutes in (0, 180, 600)]
    results = run(loaded, bursts)
    assert [summary(d) for _, d in results] == [
        ("software", "none", None, "application-fault", None),
        ("software", "none", None, "application-fault", None),
        ("hardware", "diagnose", 3, "application-signature-repeats-on-gpu", None),
    ]
    # Another GPU of the node, or a day later, starts the count again.
    assert run(loaded, [*bursts[:2], nan_loss("n1", 600, gpu=1)])[-1][1].rule == "application-fault"
    assert run(loaded, [nan_loss("n1", 0), nan_loss("n1", 180), nan_loss("n1", 1500)])[-1][1].rule == (
        "application-fault"
    )


def test_nan_on_one_gpu_in_two_jobs_is_the_gpu(loaded) -> None:
    results = run(loaded, [nan_loss("n1", 0, job="llm"), nan_loss("n1", 60, job="vision")])
    assert summary(results[-1][1]) == (
        "hardware",
        "diagnose",
        3,
        "application-signature-across-jobs-on-gpu",
        None,
    )
    same_job = run(loaded, [nan_loss("n1", 0), nan_loss("n1", 60)])
    assert same_job[-1][1].rule == "application-fault"


def test_five_fatal_xid_bursts_on_one_gpu_in_a_day_replace_it(loaded) -> None:
    # Different fatal codes, each burst a few events, three hours apart (past the cooldown).
    codes = [79, 48, 119, 79, 64]
    bursts = [xid(code, "n1", k * 180 + s) for k, code in enumerate(codes) for s in (0, 0.2, 0.5)]
    results = run(loaded, bursts)
    assert [d.action.value for _, d in results] == ["reboot", "reset_gpu", "reset_gpu", "reboot", "replace"]
    assert summary(results[-1][1]) == ("hardware", "replace", None, "fatal-xid-repeat-gpu", None)
    assert "5 episodes with XID" in results[-1][1].reason
    # Four bursts are not enough; nor are five spread over two GPUs.
    assert run(loaded, bursts[:12])[-1][1].rule == "xid-fallen-off-bus"
    other_gpu = [*bursts[:12], xid(64, "n1", 720, gpu=1)]
    assert run(loaded, other_gpu)[-1][1].rule == "xid-reset-gpu"
