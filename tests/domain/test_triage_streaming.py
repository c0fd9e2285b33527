"""`medic triage` streams: the same decisions as the whole-input replay, in memory bounded by the windows.

The reference is the batch form written out: `correlate` over every event, each incident decided
in the order it opened with every event as the context, guardrails replayed over the decisions.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from checkout import REPO_ROOT
from factories import T0, event_line, fault_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.context import Context
from medic.events import EventKind, FaultEvent
from medic.facts import facts_of, taken_out_by_us
from medic.incidents import correlate
from medic.policy import LoadedPolicy, decide, guardrails, load_policy
from medic.policy.loader import parse_policy
from medic.triage import OutOfOrder, Stream, replay, stream
from medic.triage.fleet import ReplayedFleet
from medic.triage.ids import EventIds

REPO = REPO_ROOT
DEFAULT = load_policy(REPO / "policies" / "default.yaml")
# Short windows, a storm rule, counts and guardrails that a few dozen events reach.
SMALL = LoadedPolicy(
    parse_policy(
        """
version: 1
defaults: {incident_window_minutes: 3}
guardrails:
  max_out_of_service: 2
  max_destructive_per_hour: 3
  circuit_breaker: {nodes_at_least: 2, window_minutes: 10}
rules:
  - {id: storm, description: s, override: true, when: {switch: {kinds: [nccl_timeout], nodes_at_least: 2, within_minutes: 2}},
     then: {classification: infrastructure, action: escalate}}
  - {id: timeout, description: t, when: {kinds: [nccl_timeout]}, then: {classification: unknown, action: drain}}
  - {id: xid, description: x, when: {xid: [79]}, then: {classification: hardware, action: reboot}}
  - {id: again, description: a, when: {count: [{xid: [79], scope: gpu, distinct: episodes, episode_gap_minutes: 2,
     at_least: 2, within_minutes: 20}]}, then: {classification: hardware, action: replace}}
  - {id: nan, description: n, when: {count: [{kinds: [nan_loss], scope: cluster, distinct: nodes, at_least: 2,
     within_minutes: 15}]}, then: {classification: software, action: none}}
  - {id: offender, description: o, override: true, when: {recent_remediations_at_least: 2},
     then: {classification: hardware, action: escalate}}
  - {id: back, description: b, when: {out_of_service: true, kinds: [diagnostic]},
     then: {classification: hardware, action: reintegrate}}
""",
        "small.yaml",
    ),
    "small.yaml",
    "ef" * 32,
)
KINDS = ["xid", "nccl_timeout", "nan_loss", "diagnostic", "remediation", "ecc"]
ATTRIBUTES = {
    "xid": {"code": 79},
    "nccl_timeout": {},
    "nan_loss": {},
    "diagnostic": {"level": 1, "result": "pass"},
    "remediation": {"action": "drain"},
    "ecc": {"dbe": 1},
}


def batch(events: list[FaultEvent], loaded: LoadedPolicy, fleet_size: int | None) -> list[tuple]:
    """The reference: the whole input at once."""
    policy = loaded.policy
    context = Context(events, fleet_size=fleet_size)
    fleet = ReplayedFleet(fleet_size)
    window = timedelta(minutes=policy.defaults.incident_window_minutes)
    results = []
    for incident in correlate(events, window, policy.storms()):
        now = incident.last_at
        out = incident.node in fleet.out_of_service or taken_out_by_us(incident.history)
        facts = facts_of(incident, out_of_service=out, context=context)
        decision = guardrails.apply(
            policy.guardrails,
            fleet.state(now, incident.opened_at),
            incident.node,
            decide(policy, facts, loaded.sha256),
            incident.scope,
        )
        fleet.record(incident.node, now, decision)
        results.append((incident.id, incident.nodes, [e.id for e in incident.events], decision))
    return results


def streamed(events: list[FaultEvent], loaded: LoadedPolicy, fleet_size: int | None) -> list[tuple]:
    return [
        (r.incident.id, r.incident.nodes, [e.id for e in r.incident.events], r.decision)
        for r in replay(events, loaded, fleet_size)
    ]


@st.composite
def event_lists(draw: st.DrawFn) -> list[FaultEvent]:
    """Bursts on four nodes under two switches, with quiet gaps longer than the windows."""
    events = []
    for serial in range(draw(st.integers(1, 50))):
        kind = draw(st.sampled_from(KINDS))
        node = draw(st.sampled_from(["n1", "n2", "n3", "n4"]))
        events.append(
            fault_event(
                kind,
                id=f"e{serial:02d}",
                seconds=draw(st.integers(0, 3600)),
                node=node,
                switch="s1" if node in ("n1", "n2") else "s2",
                gpu=draw(st.integers(0, 1)),
                source=draw(st.sampled_from(["medic", "agent"])),
                attributes=ATTRIBUTES[kind],
            )
        )
    return events


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=event_lists(), fleet_size=st.sampled_from([None, 4]), loaded=st.sampled_from([SMALL, DEFAULT]))
def test_streaming_decides_as_the_whole_input_does(events, fleet_size, loaded):
    assert streamed(events, loaded, fleet_size) == batch(events, loaded, fleet_size)


def test_a_long_generated_feed_decides_the_same_while_forgetting_often():
    """Thousands of events, the context pruned every 16 events: nothing a decision needs is forgotten."""
    rng = random.Random(5)
    events = []
    for serial in range(3000):
        kind = rng.choice(KINDS)
        node = f"n{rng.randrange(12)}"
        events.append(
            fault_event(
                kind,
                id=f"e{serial:04d}",
                seconds=serial * 20 + rng.randrange(15),
                node=node,
                switch=f"s{int(node[1:]) // 4}",
                gpu=rng.randrange(2),
                source=rng.choice(["medic", "agent"]),
                attributes=ATTRIBUTES[kind],
            )
        )
    streaming = Stream(SMALL, 6, prune_every=16)
    got = [r for e in events for r in streaming.push(e)] + list(streaming.finish())
    assert [(r.incident.id, r.decision) for r in got] == [(i, d) for i, _, _, d in batch(events, SMALL, 6)]


def test_events_out_of_order_within_the_slack_are_put_back_in_order():
    events = [fault_event("xid", id=f"x{i}", seconds=30 * i, node=f"n{i % 3}", code=79) for i in range(40)]
    swapped = [event for i in range(0, len(events), 2) for event in (events[i + 1], events[i])]
    assert [r.decision for r in stream(swapped, DEFAULT)] == [r.decision for r in replay(events, DEFAULT)]


def test_an_event_later_than_the_slack_is_refused():
    early = fault_event("xid", id="early", code=79)
    late = fault_event("xid", id="late", minutes=30, code=79)
    with pytest.raises(OutOfOrder, match="early"):
        list(stream([late, fault_event("xid", id="later", minutes=60, code=79), early], DEFAULT))


FEED_ATTRIBUTES = {
    EventKind.XID: {"code": 79},
    EventKind.NCCL_TIMEOUT: {},
    EventKind.JOB_CRASH: {"exit_code": 1},
    EventKind.ECC: {"dbe": 1},
}


def _feed(count: int) -> Iterator[FaultEvent]:
    """One event every half second: bursts of 16 of one kind on one of 400 nodes (each quiet for
    53 minutes between its bursts), 16 nodes a switch. Built without validation: the test is about
    what streaming holds, not about reading."""
    kinds = list(FEED_ATTRIBUTES)
    for serial in range(count):
        node = serial // 16 % 400
        kind = kinds[node % 4]
        yield FaultEvent.model_construct(
            id=f"ev-{serial:07d}",
            time=T0 + timedelta(seconds=serial / 2),
            source="agent",
            kind=kind,
            node=f"gpu-{node:03d}",
            gpu=serial % 8,
            job=f"job-{node // 8}",
            rank=serial % 8,
            iteration=serial // 16,
            switch=f"leaf-{node // 16}",
            attributes=dict(FEED_ATTRIBUTES[kind]),
        )


def test_memory_is_bounded_by_the_windows_not_the_input():
    events, window, lookback = 200_000, 10 * 60 * 2, 30 * 60 * 2  # events in 10 and 30 minutes
    loaded = LoadedPolicy(
        parse_policy(
            """
version: 1
rules:
  - {id: storm, description: s, when: {switch: {kinds: [nccl_timeout], nodes_at_least: 3}},
     then: {classification: infrastructure, action: escalate}}
  - {id: again, description: a, when: {count: [{xid: [79], scope: gpu, at_least: 3, within_minutes: 30}]},
     then: {classification: hardware, action: escalate}}
  - {id: ecc, description: e, when: {kinds: [ecc]}, then: {classification: hardware, action: drain}}
""",
            "bounded.yaml",
        ),
        "bounded.yaml",
        "",
    )
    streaming = Stream(loaded, fleet_size=400)
    decided = most_held = most_context = 0
    for serial, event in enumerate(_feed(events)):
        decided += sum(1 for _ in streaming.push(event))
        if serial % 500 == 0:
            most_held = max(most_held, streaming.held_events)
            most_context = max(most_context, streaming.context.entries)
    decided += sum(1 for _ in streaming.finish())
    assert decided >= events // 16 // 4  # every burst but those storms join
    # Events wait in the reorder slack, then up to a window (after a burst) for a storm, then up
    # to a window in their incident: a few windows' worth, whatever the length of the input.
    assert most_held <= 4 * window
    # The counted xids (a quarter of the events) of the last 30 minutes and nccl_timeouts (another
    # quarter) of the switch condition's 5, kept for up to three windows more while the oldest
    # incident waits, in at most five index entries each; and those of one pruning interval.
    assert most_context <= 5 * ((lookback + 3 * window) // 4 + (window // 2 + 3 * window) // 4 + 1024)


@pytest.mark.parametrize("wide_from", [2**32, 1_000])
def test_ids_are_remembered_compactly_and_exactly(monkeypatch: pytest.MonkeyPatch, wide_from: int) -> None:
    # Past `WIDE_FROM` bytes of ids (4 GiB; here 1,000 too) a slot takes eight bytes: still exact.
    monkeypatch.setattr("medic.triage.ids.WIDE_FROM", wide_from)
    ids = EventIds()
    assert all(ids.add(f"ev-{i}") for i in range(20_000))
    assert not any(ids.add(f"ev-{i}") for i in range(20_000))
    assert ids.add("ev-20000")
    # 20,001 ids of 2 + 7-8 bytes in the buffer, in 65,536 slots of 4 (8) bytes: about 23 (36) an id.
    assert ids.nbytes <= 20_001 * (23 if wide_from == 2**32 else 36)
    # Ids of every length the schema allows, non-ASCII too, repeated at random: as a set of strings.
    rng, seen = random.Random(7), set()
    pool = [f"{'é' * (i % 7)}{i}{'x' * (i % 200)}"[:200] for i in range(3_000)]
    for event_id in (rng.choice(pool) for _ in range(10_000)):
        assert ids.add(event_id) is (event_id not in seen)
        seen.add(event_id)


def test_a_file_out_of_time_order_prints_what_the_sorted_file_prints(tmp_path: Path) -> None:
    lines = [
        event_line(kind, id=f"e{i}", minutes=7 * i, node=f"gpu-{i % 5}", **ATTRIBUTES[kind])
        for i, kind in enumerate(KINDS * 6)
    ]
    shuffled = lines[:]
    random.Random(3).shuffle(shuffled)
    runner = CliRunner()
    results = []
    for name, content in (
        ("sorted", lines),
        ("shuffled", [*shuffled[:5], "junk", *shuffled[5:], shuffled[0]]),
    ):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(f"{line}\n" for line in content), encoding="utf-8")
        result = runner.invoke(app, ["triage", str(path), "--json"])
        assert result.exit_code == 0, result.output
        results.append(result)
    assert results[0].stdout == results[1].stdout
    assert [json.loads(line)["incident"] for line in results[1].stdout.splitlines()]
    # Each problem reported once, though the shuffled file is read twice.
    assert results[1].stderr.count("rejected") == 1
    assert results[1].stderr.count("ignored 1 repeated event ids") == 1
