"""Grouping events into incidents by node within a time window (medic/incidents.py)."""

from __future__ import annotations

import random
import re
from datetime import timedelta, timezone
from itertools import pairwise
from typing import Any

import pytest
from checkout import REPO_ROOT
from factories import T0, fault_event

from medic.events import EventKind, FaultEvent
from medic.incidents import DEFAULT_WINDOW, Incident, StormRule, Storms, correlate, incident_id
from medic.policy import load_policy
from medic.policy.model import Defaults

WINDOW = timedelta(minutes=10)


def ev(event_id: str, minutes: float = 0, **fields: Any) -> FaultEvent:
    """On gpu-017, xid 79 unless `kind=` says otherwise (a remediation is a drain)."""
    return fault_event(id=event_id, minutes=minutes, **fields)


def shape(incidents: list[Incident]) -> list[tuple[str, str, list[str], list[str]]]:
    return [(i.id, i.node, [e.id for e in i.events], [h.id for h in i.history]) for i in incidents]


def test_no_events_no_incidents() -> None:
    assert correlate([]) == []


def test_default_window_matches_the_policy_default() -> None:
    assert DEFAULT_WINDOW == timedelta(minutes=Defaults().incident_window_minutes) == timedelta(minutes=10)


def test_a_storm_on_one_node_is_one_incident() -> None:
    storm = [
        ev(f"ev-{n:03}", minutes=n * 9 / 200, kind=("xid", "ecc", "nccl_timeout")[n % 3]) for n in range(200)
    ]
    incidents = correlate(storm, WINDOW)
    assert len(incidents) == 1
    (incident,) = incidents
    assert incident.node == "gpu-017"
    assert len(incident.events) == 200
    assert incident.opened_at == T0
    assert incident.last_at == storm[-1].time
    assert incident.id == incident_id("gpu-017", "ev-000")


def test_the_window_is_measured_from_the_last_event() -> None:
    # Every event is within the window of the previous one, so the burst never closes.
    chain = [ev(f"ev-{n}", minutes=n * 9) for n in range(10)]
    (incident,) = correlate(chain, WINDOW)
    assert incident.last_at - incident.opened_at == timedelta(minutes=81)


def test_events_further_apart_than_the_window_are_two_incidents() -> None:
    events = [ev("a1", 0), ev("a2", 5), ev("b1", 15.01), ev("b2", 16)]
    first, second = correlate(events, WINDOW)
    assert [e.id for e in first.events] == ["a1", "a2"]
    assert [e.id for e in second.events] == ["b1", "b2"]
    assert first.id != second.id
    assert first.node == second.node == "gpu-017"


def test_an_event_exactly_one_window_later_joins() -> None:
    assert len(correlate([ev("a", 0), ev("b", 10)], WINDOW)) == 1
    assert len(correlate([ev("a", 0), ev("b", 10.001)], WINDOW)) == 2


def test_the_window_is_a_parameter() -> None:
    events = [ev("a", 0), ev("b", 20)]
    assert len(correlate(events, timedelta(minutes=10))) == 2
    assert len(correlate(events, timedelta(minutes=30))) == 1
    assert len(correlate(events)) == 2  # default 10 minutes


def test_different_nodes_are_different_incidents() -> None:
    events = [ev("a1", 0, node="gpu-001"), ev("b1", 0, node="gpu-002"), ev("a2", 1, node="gpu-001")]
    incidents = correlate(events, WINDOW)
    assert [(i.node, [e.id for e in i.events]) for i in incidents] == [
        ("gpu-001", ["a1", "a2"]),
        ("gpu-002", ["b1"]),
    ]
    assert incidents[0].id != incidents[1].id
    for incident in incidents:
        assert incident.nodes == [incident.node]


def test_interleaved_storms_on_many_nodes() -> None:
    events = [ev(f"{node}-{n}", n * 0.1, node=node) for n in range(50) for node in ("n1", "n2", "n3")]
    incidents = correlate(events, WINDOW)
    assert sorted(i.node for i in incidents) == ["n1", "n2", "n3"]
    assert all(len(i.events) == 50 for i in incidents)
    assert all({e.node for e in i.events} == {i.node} for i in incidents)


def test_incidents_come_oldest_first_and_events_in_time_order() -> None:
    events = [ev("late", 30, node="n1"), ev("early2", 1, node="n2"), ev("early1", 0, node="n2")]
    incidents = correlate(events, WINDOW)
    assert [(i.node, [e.id for e in i.events]) for i in incidents] == [
        ("n2", ["early1", "early2"]),
        ("n1", ["late"]),
    ]


def test_utc_offsets_are_compared_as_instants() -> None:
    plus_two = timezone(timedelta(hours=2))
    early = fault_event("nan_loss", id="b", at=T0.astimezone(plus_two), source="s", node="n")
    late = fault_event("nan_loss", id="a", minutes=5, source="s", node="n")
    (incident,) = correlate([late, early], WINDOW)
    assert [e.id for e in incident.events] == ["b", "a"]


def test_incident_ids_are_stable_across_replays() -> None:
    events = [ev("a", 0), ev("b", 30), ev("c", 1, node="other")]
    first = shape(correlate(events, WINDOW))
    assert shape(correlate(events, WINDOW)) == first
    assert shape(correlate(list(events), WINDOW)) == first
    assert [i.id for i in correlate(events, WINDOW)] == [
        incident_id("gpu-017", "a"),
        incident_id("other", "c"),
        incident_id("gpu-017", "b"),
    ]


def test_incident_ids_do_not_depend_on_input_order() -> None:
    events = [
        *(ev(f"s{n}", n * 0.5) for n in range(30)),
        *(ev(f"t{n}", 40 + n) for n in range(5)),
        *(ev(f"o{n}", n, node="gpu-002") for n in range(5)),
        ev("fix", 20, kind="remediation"),
        ev("tie-b", 100, node="gpu-003"),
        ev("tie-a", 100, node="gpu-003"),  # same instant: ordered by id
    ]
    expected = shape(correlate(events, WINDOW))
    rng = random.Random(7)
    for _ in range(20):
        shuffled = events[:]
        rng.shuffle(shuffled)
        assert shape(correlate(iter(shuffled), WINDOW)) == expected
    assert [i.id for i in correlate(events, WINDOW)][-1] == incident_id("gpu-003", "tie-a")


def test_incident_id_format_and_inputs() -> None:
    value = incident_id("gpu-017", "ev-1")
    assert re.fullmatch(r"inc-[0-9a-f]{10}", value)
    assert incident_id("gpu-017", "ev-1") == value
    assert incident_id("gpu-018", "ev-1") != value
    assert incident_id("gpu-017", "ev-2") != value
    # The separator keeps node/id pairs that concatenate alike apart.
    assert incident_id("gpu-01", "7ev-1") != incident_id("gpu-017", "ev-1")


def test_remediation_events_alone_open_nothing() -> None:
    assert correlate([ev("r1", 0, kind="remediation"), ev("r2", 1, kind="remediation")], WINDOW) == []


def test_what_people_did_opens_joins_and_extends_nothing_even_if_a_storm_rule_counts_it() -> None:
    """`node_state` events are evidence of people's actions (docs/decisions/0019): never trouble."""
    people = [ev(f"p{n}", n, node=f"gpu-0{n}", switch="leaf-1", kind="node_state") for n in range(5)]
    storms = Storms((StormRule(frozenset({EventKind.NODE_STATE}), timedelta(minutes=10), nodes_at_least=2),))
    assert correlate(people, WINDOW, storms) == []
    # A drain by people between two faults 15 minutes apart does not bridge them, nor is it history.
    incidents = correlate([ev("x1", 0), ev("p-between", 8, kind="node_state"), ev("x2", 15)], WINDOW)
    assert [([e.id for e in i.events], i.history) for i in incidents] == [(["x1"], []), (["x2"], [])]


def test_remediation_is_history_of_that_nodes_incident() -> None:
    events = [
        ev("drain-1", 0, kind="remediation"),
        ev("x1", 5),
        ev("drain-other", 1, node="gpu-099", kind="remediation"),
        ev("x2", 6),
    ]
    (incident,) = correlate(events, WINDOW)
    assert [e.id for e in incident.events] == ["x1", "x2"]
    assert [h.id for h in incident.history] == ["drain-1"]
    assert all(e.kind != "remediation" for e in incident.events)


def test_remediation_does_not_extend_the_window() -> None:
    events = [ev("x1", 0), ev("reboot", 8, kind="remediation"), ev("x2", 15)]
    first, second = correlate(events, WINDOW)
    assert [e.id for e in first.events] == ["x1"]
    assert [e.id for e in second.events] == ["x2"]
    assert first.history == []  # the reboot came after x1, the last event of the first incident
    assert [h.id for h in second.history] == ["reboot"]


def test_history_accumulates_over_a_nodes_incidents() -> None:
    events = [
        ev("r1", 0, kind="remediation"),
        ev("x1", 1),
        ev("r2", 2, kind="remediation"),
        ev("x2", 3),
        ev("r3", 60, kind="remediation"),
        ev("x3", 90),
        ev("r4", 200, kind="remediation"),
    ]
    first, second = correlate(events, WINDOW)
    assert [h.id for h in first.history] == ["r1", "r2"]
    assert [h.id for h in second.history] == ["r1", "r2", "r3"]
    assert first.id == incident_id("gpu-017", "x1")  # a remediation is never the first event


def test_incident_summaries() -> None:
    events = [
        ev("a", 0, job="48213", switch="leaf-04"),
        ev("b", 1, job="48000"),
        ev("c", 2, job="48213"),
        ev("d", 3),
    ]
    (incident,) = correlate(events, WINDOW)
    assert incident.jobs == ["48000", "48213"]
    assert incident.switch == "leaf-04"
    assert incident.nodes == ["gpu-017"]
    assert (incident.opened_at, incident.last_at) == (T0, T0 + timedelta(minutes=3))


def test_switch_is_none_when_no_event_names_one() -> None:
    (incident,) = correlate([ev("a", 0)], WINDOW)
    assert incident.switch is None
    assert incident.jobs == []


@pytest.mark.parametrize("window_minutes", [1, 10, 60])
def test_storm_with_gaps_splits_exactly_at_gaps_larger_than_the_window(window_minutes: int) -> None:
    window = timedelta(minutes=window_minutes)
    offsets = [0, 0.5, 0.9, 5, 5.5, 30, 31, 200]
    events = [ev(f"e{n}", minutes) for n, minutes in enumerate(offsets)]
    expected = 1 + sum(1 for a, b in pairwise(offsets) if b - a > window_minutes)
    assert len(correlate(events, window)) == expected


# --- Switch-wide storms -------------------------------------------------------------------------

STORM = StormRule(frozenset({EventKind.NCCL_TIMEOUT}), timedelta(minutes=5), nodes_at_least=4)


def timeout(event_id: str, node: str, minutes: float = 0, switch: str = "leaf-1") -> FaultEvent:
    return ev(event_id, minutes, node=node, kind="nccl_timeout", switch=switch)


def test_a_storm_under_one_switch_is_one_switch_incident() -> None:
    storm = [timeout(f"t{k}-{n}", f"n{n}", k / 10) for k in range(5) for n in range(1, 9)]
    bystander = ev("x1", 0.2, node="n1", switch="leaf-1")  # an XID is no storm's: n1 keeps its own
    elsewhere = timeout("t-far", "m1", 0.1, switch="leaf-2")
    incidents = correlate([*storm, bystander, elsewhere], WINDOW, Storms((STORM,)))
    assert [(i.scope, i.node, len(i.events)) for i in incidents] == [
        ("switch", "leaf-1", 40),
        ("node", "m1", 1),
        ("node", "n1", 1),
    ]
    switch = incidents[0]
    assert switch.nodes == [f"n{n}" for n in range(1, 9)]
    assert switch.subject == "switch leaf-1 (8 nodes)"
    assert switch.id == incident_id("switch:leaf-1", min(e.id for e in storm if e.time == T0))


def test_too_few_nodes_or_too_slow_is_no_storm() -> None:
    few = [timeout(f"f{n}", f"n{n}", 0) for n in range(1, 4)]
    slow = [timeout(f"s{n}", f"n{n}", n * 2) for n in range(1, 5)]  # 4 nodes, but over 6 minutes
    for events in (few, slow):
        incidents = correlate(events, WINDOW, Storms((STORM,)))
        assert {i.scope for i in incidents} == {"node"} and len(incidents) == len(events)


def test_a_fraction_of_the_switch_needs_its_size() -> None:
    share = StormRule(frozenset({EventKind.NCCL_TIMEOUT}), timedelta(minutes=5), fraction_at_least=0.5)
    two = [timeout("a", "n1"), timeout("b", "n2")]
    assert len(correlate(two, WINDOW, Storms((share,), {"leaf-1": 4}))) == 1
    assert len(correlate(two, WINDOW, Storms((share,), {"leaf-1": 8}))) == 2
    assert len(correlate(two, WINDOW, Storms((share,)))) == 2  # size unknown: no fraction


def test_storms_an_hour_apart_are_two_incidents() -> None:
    first = [timeout(f"a{n}", f"n{n}", 0) for n in range(1, 5)]
    second = [timeout(f"b{n}", f"n{n}", 60) for n in range(1, 5)]
    incidents = correlate([*second, *first], WINDOW, Storms((STORM,)))
    assert [(i.scope, [e.id for e in i.events]) for i in incidents] == [
        ("switch", ["a1", "a2", "a3", "a4"]),
        ("switch", ["b1", "b2", "b3", "b4"]),
    ]


def test_the_default_policy_defines_the_storm_it_decides_on() -> None:
    policy = load_policy(REPO_ROOT / "policies" / "default.yaml").policy
    storms = policy.storms({"leaf-1": 8})
    assert storms.kinds == {EventKind.NCCL_TIMEOUT}
    assert storms.is_storm("leaf-1", [timeout(f"d{n}", f"n{n}") for n in range(1, 5)])
    assert not storms.is_storm("leaf-1", [timeout(f"d{n}", f"n{n}") for n in range(1, 4)])
