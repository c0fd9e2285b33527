"""A crash a peer's loss caused is evidence, not a fault of its own node (medic/victims.py), on the
events a real gloo job wrote when one of its ranks died (tests/fixtures/hangs/README.md)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from factories import fault_event

from medic.culprit import Differential, differential
from medic.events import EventKind, FaultEvent
from medic.victims import SETTLE, is_peer_loss

RECORDED = Path(__file__).parents[1] / "fixtures" / "hangs" / "peer-loss-gloo.jsonl"


def recorded() -> tuple[FaultEvent, FaultEvent]:
    died, survivor = (FaultEvent.model_validate_json(line) for line in RECORDED.read_text().splitlines())
    assert (died.rank, died.attributes["exit_code"], survivor.rank) == (1, 13, 0)
    return died, survivor


def test_the_survivor_of_a_dead_peer_opens_nothing_and_the_dead_rank_s_crash_goes_on() -> None:
    died, survivor = recorded()
    assert is_peer_loss(survivor) and not is_peer_loss(died)
    assert differential([died, survivor]) == [died]


def test_a_peer_loss_nothing_explains_goes_on_as_it_came_once_it_settles() -> None:
    _, survivor = recorded()
    diff = Differential()
    assert diff.push(survivor) == []
    assert diff.next_due() == survivor.time + SETTLE
    assert diff.due(survivor.time + SETTLE - timedelta(seconds=1)) == []
    assert diff.due(survivor.time + SETTLE) == [survivor]  # never taken for a healthy node unexplained


def test_the_node_agent_s_xid_on_the_peer_s_node_explains_it() -> None:
    died, survivor = recorded()
    known = fault_event(
        "health_check", job=died.job, rank=1, node="node-b", at=died.time - timedelta(minutes=5)
    )
    xid = fault_event("xid", node="node-b", at=survivor.time + timedelta(seconds=3), attributes={"code": 79})
    diff = Differential()
    out = [found for event in (known, survivor, xid) for found in diff.push(event)] + diff.flush()
    assert [e.kind for e in out] == [EventKind.HEALTH_CHECK, EventKind.XID]
    assert diff.take_explained() == [(survivor.id, xid.id)]  # for the store to mark it (a start skips it)
    # A fault on the survivor's own node, or long after, explains nothing.
    own = xid.model_copy(update={"node": "node-a"})
    late = xid.model_copy(update={"time": survivor.time + SETTLE + timedelta(seconds=1)})
    assert survivor in differential([known, survivor, own])
    assert survivor in differential([known, survivor, late])
