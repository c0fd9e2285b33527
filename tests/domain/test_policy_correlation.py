"""Cross-node conditions (`count`, `switch`, `dcgm_category`) on small inline policies.

Events go through the real path: `correlate` groups them, `facts_of` distils the incident
with a `Context` of every event, `decide` answers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import pytest
from factories import T0, fault_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medic.context import Context
from medic.events import FaultEvent
from medic.facts import Facts, facts_of
from medic.incidents import correlate
from medic.policy import Action, Decision, Policy, decide
from medic.policy.engine import diagnose_level, match
from medic.policy.loader import parse_policy
from medic.policy.model import ACTION_RANK


def event(kind: str, node: str = "n1", minutes: float = 0, gpu: int | None = 0, **fields: Any) -> FaultEvent:
    """`fields` are envelope fields (job, rank, iteration, switch) or `attributes`."""
    return fault_event(kind, node=node, minutes=minutes, gpu=gpu, **fields)


def xid79(node: str = "n1", minutes: float = 0, gpu: int | None = 0, **fields: Any) -> FaultEvent:
    return event("xid", node, minutes, gpu, **fields)  # the factory's xid is 79


def one_rule(when: Mapping[str, Any]) -> Policy:
    """A policy whose only rule `r` reboots when `when` holds (JSON is YAML, so no quoting worries)."""
    then = {"classification": "hardware", "action": "reboot"}
    text = json.dumps(
        {"version": 1, "rules": [{"id": "r", "description": "Rule r", "when": when, "then": then}]}
    )
    return parse_policy(text, "inline.yaml")


def facts_for(
    events: list[FaultEvent],
    node: str,
    *,
    now: datetime | None = None,
    switch_sizes: Mapping[str, int] | None = None,
) -> Facts:
    """Facts of the latest incident on `node`, seeing every event as its cluster context."""
    incident = [i for i in correlate(events) if i.node == node][-1]
    context = Context(events, switch_sizes=switch_sizes, fleet_size=8)
    return facts_of(incident, now=now, context=context)


def decision(policy: Policy, events: list[FaultEvent], node: str = "n1", **kw: Any) -> Decision:
    return decide(policy, facts_for(events, node, **kw))


def holds(when: Mapping[str, Any], events: list[FaultEvent], node: str = "n1", **kw: Any) -> bool:
    return decision(one_rule(when), events, node, **kw).rule == "r"


def count(**cond: Any) -> dict[str, Any]:
    return {"count": [{"xid": [79], **cond}]}


# --- Scope ---------------------------------------------------------------------------------

# The incident is n1's XID 79 on GPU 0 in job A at minute 0 (a burst of its own). Around it:
SCOPED = [
    xid79("n1", -40, gpu=0, job="A"),
    xid79("n1", -30, gpu=1, job="B"),
    xid79("n1", -20, gpu=0, job="B"),
    xid79("n2", -15, gpu=0, job="A"),
    xid79("n3", -5, gpu=0),
    event("xid", "n1", -25, gpu=0, job="A", attributes={"code": 13}),  # not the signature
    xid79("n1", 0, gpu=0, job="A"),
]


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        ("gpu", 3),  # n1 GPU 0 at -40, -20, 0: another node's GPU 0 is another GPU
        ("node", 4),  # every XID 79 on n1
        ("job", 3),  # job A: n1 -40, n2 -15, n1 0
        ("cluster", 6),
    ],
)
def test_each_scope_counts_its_own_events(scope: str, expected: int) -> None:
    assert holds(count(scope=scope, at_least=expected), SCOPED)
    assert not holds(count(scope=scope, at_least=expected + 1), SCOPED)
    reason = decision(one_rule(count(scope=scope, at_least=expected)), SCOPED).reason
    assert f"{expected} events with XID 79" in reason


def test_the_incident_must_itself_show_the_signature() -> None:
    others = [xid79(f"n{k}", -k) for k in range(2, 7)]
    lone_crash = event("job_crash", "n1", 0, attributes={"exit_code": 1})
    assert holds(count(scope="cluster", at_least=5), [*others, xid79("n1", 0)])
    assert not holds(count(scope="cluster", at_least=1), [*others, lone_crash])


def test_a_job_scope_needs_the_incident_to_name_a_job() -> None:
    events = [xid79("n2", -3, job="A"), xid79("n3", -2, job="A"), xid79("n1", 0)]
    assert holds(count(scope="cluster", at_least=3), events)
    assert not holds(count(scope="job", at_least=1), events)


def test_kinds_and_xid_codes_together_make_one_signature() -> None:
    events = [
        event("nan_loss", "n2", -3),
        event("xid", "n3", -2, attributes={"code": 13}),
        event("xid", "n4", -1, attributes={"code": 31}),  # a code not listed: not counted
        event("nan_loss", "n1", 0),
    ]
    when = {"count": [{"kinds": ["nan_loss"], "xid": [13], "scope": "cluster", "at_least": 3}]}
    assert holds(when, events)
    assert not holds({"count": [{**when["count"][0], "at_least": 4}]}, events)


def test_every_count_in_the_list_must_hold() -> None:
    events = [xid79("n2", -2), xid79("n1", 0)]
    node_one = {"xid": [79], "scope": "node", "at_least": 1}
    cluster_two = {"xid": [79], "scope": "cluster", "at_least": 2}
    assert holds({"count": [node_one, cluster_two]}, events)
    assert not holds({"count": [node_one, {**cluster_two, "at_least": 3}]}, events)


# --- Distinct ------------------------------------------------------------------------------

# n1 (the incident) on GPUs 0 and 1 in job A, n2 and n3 on GPU 0 in job B, n4 with neither.
MIXED = [
    xid79("n2", -4, gpu=0, job="B"),
    xid79("n3", -3, gpu=0, job="B"),
    xid79("n4", -2, gpu=None),
    xid79("n1", -1, gpu=1, job="A"),
    xid79("n1", 0, gpu=0, job="A"),
]


@pytest.mark.parametrize(
    ("distinct", "expected"),
    [
        ("events", 5),
        ("episodes", 1),  # all within a few minutes: one burst
        ("nodes", 4),
        ("jobs", 2),  # an event without a job names none
        ("gpus", 4),  # (node, GPU) pairs; n4's event names no GPU
    ],
)
def test_each_distinct_mode(distinct: str, expected: int) -> None:
    assert holds(count(scope="cluster", distinct=distinct, at_least=expected), MIXED)
    assert not holds(count(scope="cluster", distinct=distinct, at_least=expected + 1), MIXED)


# --- Episodes ------------------------------------------------------------------------------


def test_a_storm_of_twenty_events_in_a_minute_is_one_episode() -> None:
    storm = [xid79("n1", k * 3 / 60) for k in range(20)]
    assert holds(count(scope="gpu", distinct="events", at_least=20), storm)
    assert holds(count(scope="gpu", distinct="episodes", at_least=1), storm)
    assert not holds(count(scope="gpu", distinct="episodes", at_least=2), storm)


FIVE_BURSTS = [xid79("n1", hour * 60 + second / 60) for hour in range(5) for second in (0, 10, 20, 30)]


def test_five_bursts_an_hour_apart_are_five_episodes() -> None:
    when = count(scope="gpu", distinct="episodes", at_least=5, within_minutes=1440)
    assert holds(when, FIVE_BURSTS)
    assert not holds(count(scope="gpu", distinct="episodes", at_least=6, within_minutes=1440), FIVE_BURSTS)
    assert (
        "5 episodes with XID 79 on this GPU within 1440 min" in decision(one_rule(when), FIVE_BURSTS).reason
    )


def test_the_episode_gap_decides_what_is_one_burst() -> None:
    wide = {"scope": "gpu", "distinct": "episodes", "within_minutes": 1440, "episode_gap_minutes": 61}
    assert holds(count(**wide, at_least=1), FIVE_BURSTS)
    assert not holds(count(**wide, at_least=2), FIVE_BURSTS)
    # A gap of exactly the limit still joins the burst; only a longer one separates.
    assert not holds(count(**{**wide, "episode_gap_minutes": 60}, at_least=2), FIVE_BURSTS)
    assert holds(count(**{**wide, "episode_gap_minutes": 59}, at_least=5), FIVE_BURSTS)


# --- Same iteration and rank ---------------------------------------------------------------

SAME_STEP = {
    "count": [
        {
            "kinds": ["nan_loss"],
            "scope": "cluster",
            "distinct": "nodes",
            "same_iteration_rank": True,
            "at_least": 2,
        }
    ]
}


def nan(node: str, iteration: int | None, rank: int | None, minutes: float = 0) -> FaultEvent:
    return event("nan_loss", node, minutes, job="J", iteration=iteration, rank=rank)


def test_the_same_iteration_and_rank_on_two_nodes_matches() -> None:
    events = [nan("n2", 1200, 3, -2), nan("n1", 1200, 3)]
    assert holds(SAME_STEP, events)
    assert "2 nodes with nan_loss at the same iteration and rank in the cluster" in (
        decision(one_rule(SAME_STEP), events).reason
    )


@pytest.mark.parametrize(
    "other",
    [
        nan("n2", 1201, 3, -2),  # another iteration
        nan("n2", 1200, 4, -2),  # another rank
        nan("n2", None, None, -2),  # says neither
    ],
)
def test_another_iteration_or_rank_does_not_match(other: FaultEvent) -> None:
    assert not holds(SAME_STEP, [other, nan("n1", 1200, 3)])
    # Without the mark, the two nodes are enough.
    loose = {"count": [{**SAME_STEP["count"][0], "same_iteration_rank": False}]}
    assert holds(loose, [other, nan("n1", 1200, 3)])


def test_an_incident_without_iteration_and_rank_never_matches_same_step() -> None:
    assert not holds(SAME_STEP, [nan("n2", None, None, -2), nan("n1", None, None)])


# --- Windows -------------------------------------------------------------------------------


def test_events_older_than_the_window_do_not_count() -> None:
    events = [xid79("n2", -61), xid79("n3", -59), xid79("n1", 0)]
    assert holds(count(scope="cluster", at_least=2, within_minutes=60), events)
    assert not holds(count(scope="cluster", at_least=3, within_minutes=60), events)
    assert holds(count(scope="cluster", at_least=3, within_minutes=61), events)


def test_windows_end_at_the_incidents_newest_fault_not_at_the_decision() -> None:
    events = [xid79("n1", 0), xid79("n2", 5), xid79("n3", 20)]
    three = count(scope="cluster", at_least=3, within_minutes=30)
    assert not holds(three, events)  # n1's incident ended before the others happened
    # Deciding again much later (after a long diagnostic) sees the same window, not a later one.
    assert not holds(three, events, now=T0 + timedelta(minutes=25))
    assert holds(three, events, node="n3", now=T0 + timedelta(minutes=90))
    # n3's incident at minute 20: only its own event lies in the last 10 minutes before it.
    assert holds(count(scope="cluster", at_least=1, within_minutes=10), events, node="n3")
    assert not holds(count(scope="cluster", at_least=2, within_minutes=10), events, node="n3")


# --- Switch --------------------------------------------------------------------------------


def timeouts(nodes: int, switch: str = "sw1", start: float = -4) -> list[FaultEvent]:
    """`nodes` other nodes (named for the switch and start) time out half a minute apart."""
    return [event("nccl_timeout", f"{switch}{start}-{k}", start + k / 2, switch=switch) for k in range(nodes)]


def storm(*before: FaultEvent) -> list[FaultEvent]:
    return [*before, event("nccl_timeout", "n1", 0, switch="sw1")]


BY_COUNT = {"switch": {"kinds": ["nccl_timeout"], "nodes_at_least": 4}}
BY_FRACTION = {"switch": {"kinds": ["nccl_timeout"], "fraction_at_least": 0.5}}


def test_switch_by_node_count() -> None:
    assert holds(BY_COUNT, storm(*timeouts(3)))
    assert not holds(BY_COUNT, storm(*timeouts(2)))
    assert (
        "4 nodes under sw1 report nccl_timeout within 5 min"
        in decision(one_rule(BY_COUNT), storm(*timeouts(3))).reason
    )


def test_switch_counts_nodes_not_events() -> None:
    repeated = [event("nccl_timeout", "other", -3 + k / 10, switch="sw1") for k in range(10)]
    assert not holds(BY_COUNT, storm(*repeated, *timeouts(1, start=-1)))


def test_switch_ignores_other_switches_and_old_events() -> None:
    assert not holds(BY_COUNT, storm(*timeouts(2), *timeouts(3, switch="sw2")))
    assert not holds(BY_COUNT, storm(*timeouts(2), *timeouts(1, start=-6)))
    assert holds(
        {"switch": {**BY_COUNT["switch"], "within_minutes": 7}}, storm(*timeouts(2), *timeouts(1, start=-6))
    )


def test_switch_needs_the_incident_to_report_the_kind() -> None:
    crash = event("job_crash", "n1", 0, switch="sw1", attributes={"exit_code": 1})
    assert not holds(BY_COUNT, [*timeouts(6), crash])


def test_switch_by_fraction_needs_the_switch_size() -> None:
    events = storm(*timeouts(3))
    assert holds(BY_FRACTION, events, switch_sizes={"sw1": 8})
    assert not holds(BY_FRACTION, events, switch_sizes={"sw1": 9})
    assert not holds(BY_FRACTION, events)  # size unknown: a fraction cannot hold
    assert "4 of 8 nodes under sw1" in decision(one_rule(BY_FRACTION), events, switch_sizes={"sw1": 8}).reason


def test_switch_count_or_fraction_either_is_enough() -> None:
    both = {"switch": {"kinds": ["nccl_timeout"], "nodes_at_least": 4, "fraction_at_least": 0.5}}
    assert holds(both, storm(*timeouts(1)), switch_sizes={"sw1": 4})  # 2 of 4
    assert holds(both, storm(*timeouts(3)), switch_sizes={"sw1": 64})  # 4 nodes
    assert not holds(both, storm(*timeouts(2)), switch_sizes={"sw1": 64})


# --- DCGM category -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error_id", "category", "matches"),
    [
        ("DCGM_FR_VOLATILE_DBE_DETECTED", "HARDWARE_MEMORY", True),
        ("DCGM_FR_NVLINK_DOWN", "HARDWARE_MEMORY", False),
        ("DCGM_FR_NVLINK_DOWN", "HARDWARE_NVLINK", True),
        (3, "HARDWARE_PCIE", True),  # DCGM_FR_PCI_REPLAY_RATE by its numeric id
        ("DCGM_FR_NOT_A_THING", "UNKNOWN", True),  # an error missing from the table
    ],
)
def test_dcgm_category(error_id: int | str, category: str, matches: bool) -> None:
    events = [event("dcgm_health", "n1", 0, attributes={"error_id": error_id})]
    assert holds({"dcgm_category": [category]}, events) is matches


def test_dcgm_category_looks_only_at_health_events() -> None:
    failed = event("diagnostic", "n1", 0, attributes={"level": 1, "result": "fail", "error_ids": [3]})
    assert not holds({"dcgm_category": ["HARDWARE_PCIE"]}, [failed])


# --- The kind prefilter never changes a decision --------------------------------------------

KINDS = ["xid", "nan_loss", "nccl_timeout", "dcgm_health", "ecc", "straggler", "diagnostic", "job_crash"]
ATTRIBUTES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "xid": st.fixed_dictionaries({"code": st.sampled_from([13, 48, 79])}),
    "nan_loss": st.just({}),
    "nccl_timeout": st.just({}),
    "dcgm_health": st.fixed_dictionaries(
        {"error_id": st.sampled_from(["DCGM_FR_VOLATILE_DBE_DETECTED", "DCGM_FR_NVLINK_DOWN", 3, 999])}
    ),
    "ecc": st.fixed_dictionaries({"dbe": st.integers(0, 2)}),
    "straggler": st.fixed_dictionaries({"step_time_ratio": st.sampled_from([1.0, 1.5])}),
    "diagnostic": st.fixed_dictionaries(
        {"level": st.integers(1, 3), "result": st.sampled_from(["pass", "fail"]), "error_ids": st.just([3])}
    ),
    "job_crash": st.just({"exit_code": 1}),
}
kind_lists = st.lists(st.sampled_from(KINDS), min_size=1, max_size=4, unique=True)

conditions: dict[str, st.SearchStrategy[Any]] = {
    "kinds": kind_lists,
    "not_kinds": kind_lists,
    "xid": st.lists(st.sampled_from([13, 48, 79]), min_size=1, max_size=2),
    "dcgm_category": st.lists(
        st.sampled_from(["HARDWARE_MEMORY", "HARDWARE_NVLINK", "HARDWARE_PCIE", "UNKNOWN"]), min_size=1
    ),
    "ecc_dbe_at_least": st.integers(1, 2),
    "straggler": st.fixed_dictionaries({"reports_at_least": st.just(1)}),
    "diagnostic": st.fixed_dictionaries({}, optional={"result": st.sampled_from(["pass", "fail"])}),
    "out_of_service": st.booleans(),
    "min_events": st.integers(1, 3),
    "count": st.lists(
        st.fixed_dictionaries(
            {
                "kinds": st.lists(st.sampled_from(KINDS), min_size=2, max_size=4, unique=True),
                "scope": st.sampled_from(["gpu", "node", "job", "cluster"]),
                "distinct": st.sampled_from(["events", "episodes", "nodes", "jobs", "gpus"]),
                "same_iteration_rank": st.booleans(),
                "at_least": st.integers(1, 2),
                "within_minutes": st.sampled_from([5, 60]),
            },
            optional={"xid": st.lists(st.sampled_from([13, 79]), min_size=1, max_size=2)},
        ),
        min_size=1,
        max_size=2,
    ),
    "switch": st.fixed_dictionaries(
        {"kinds": kind_lists, "within_minutes": st.sampled_from([5, 60])},
        optional={"nodes_at_least": st.integers(1, 2), "fraction_at_least": st.sampled_from([0.25, 0.5])},
    ).filter(lambda s: "nodes_at_least" in s or "fraction_at_least" in s),
}


@st.composite
def random_policies(draw: st.DrawFn) -> Policy:
    rules = []
    for n in range(draw(st.integers(1, 8))):
        names = draw(st.lists(st.sampled_from(sorted(conditions)), min_size=1, max_size=2, unique=True))
        action = draw(st.sampled_from([a.value for a in Action]))
        then: dict[str, Any] = {"classification": "hardware", "action": action}
        if action == "diagnose":
            then["diagnose_level"] = draw(st.sampled_from([1, 2, "next"]))
        rules.append(
            {
                "id": f"r{n}",
                "description": f"rule {n}",
                "priority": draw(st.integers(-1, 1)),
                "override": draw(st.booleans()),
                "when": {name: draw(conditions[name]) for name in names},
                "then": then,
            }
        )
    return Policy.model_validate({"rules": rules})


@st.composite
def cluster_events(draw: st.DrawFn) -> FaultEvent:
    kind = draw(st.sampled_from(KINDS))
    return fault_event(
        kind,
        id=f"p{draw(st.integers(0, 10**6))}",
        minutes=draw(st.integers(0, 40)),
        source="prop",
        node=draw(st.sampled_from(["n1", "n2", "n3"])),
        gpu=draw(st.none() | st.integers(0, 1)),
        job=draw(st.none() | st.sampled_from(["j1", "j2"])),
        iteration=draw(st.none() | st.integers(1, 2)),
        rank=draw(st.none() | st.integers(0, 1)),
        switch=draw(st.none() | st.sampled_from(["sw1", "sw2"])),
        attributes=draw(ATTRIBUTES[kind]),
    )


def brute_force(policy: Policy, facts: Facts) -> list[str]:
    """Every rule evaluated in full, no prefilter, sorted by docs/policy.md's precedence."""
    found = []
    for index, rule in enumerate(policy.rules):
        if match(rule, facts) is None:
            continue
        if rule.then.action is Action.DIAGNOSE and diagnose_level(rule, facts) is None:
            continue
        found.append(((rule.override, ACTION_RANK[rule.then.action], rule.priority, -index), rule.id))
    return [rule_id for _, rule_id in sorted(found, reverse=True)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=random_policies(),
    events=st.lists(cluster_events(), min_size=15, max_size=40, unique_by=lambda e: e.id),
    out_of_service=st.booleans(),
)
def test_the_kind_prefilter_never_changes_a_decision(
    policy: Policy, events: list[FaultEvent], out_of_service: bool
) -> None:
    context = Context(events, switch_sizes={"sw1": 4, "sw2": 8}, fleet_size=4)
    for incident in correlate(events):
        facts = facts_of(incident, out_of_service=out_of_service, context=context)
        expected = brute_force(policy, facts)
        got = decide(policy, facts)
        assert got.matched == expected
        assert got.rule == (expected[0] if expected else "default")
