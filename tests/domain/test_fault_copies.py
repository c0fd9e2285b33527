"""A fault's copies join the incident that handled it (docs/decisions/0013); the nodes we hold.

Copies (new ids; same node, GPU, kind and XID) that arrive after their incident acted, or was handed to
people, join it as late evidence while the fault's burst goes on, or while the incident holds the node:
no second incident, so no second escalation or destructive request. A different fault, or the same one
after a quiet window on a node we returned, is a new incident. On SQLite and PostgreSQL.
"""

from __future__ import annotations

from datetime import timedelta

from factories import fault_event, incident

from medic.events import FaultEvent
from medic.incidents import copies_of_handled, fault_signature
from medic.statuses import ActionStatus, IncidentStatus
from medic.store import Store, utcnow

WINDOW = timedelta(minutes=10)


def _sig(event: FaultEvent) -> tuple[str, int | None, object]:
    return fault_signature(event.kind, event.gpu, event.attributes)


def test_a_copy_shares_node_gpu_kind_and_the_faults_name_whatever_its_text() -> None:
    first = fault_event(node="n1", gpu=3, code=79, message="GPU has fallen off the bus")
    assert _sig(fault_event(node="n1", gpu=3, code=79, message="other text", source="kernel-log")) == _sig(
        first
    )
    assert _sig(fault_event(node="n1", gpu=4, code=79)) != _sig(first)
    assert _sig(fault_event(node="n1", gpu=3, code=48)) != _sig(first)
    assert _sig(fault_event("ecc", node="n1", gpu=3)) != _sig(first)


def test_copies_go_on_within_the_window_of_the_latest_one_or_for_as_long_as_the_node_is_held() -> None:
    first = fault_event(gpu=0, code=79)
    evidence = [(_sig(first), first.time)]
    chain = [fault_event(gpu=0, code=79, minutes=m) for m in (9, 18, 27)]  # each 9 min after the one before
    assert copies_of_handled(chain, evidence, WINDOW, held=False)
    late = [fault_event(gpu=0, code=79, minutes=11)]
    assert not copies_of_handled(late, evidence, WINDOW, held=False)
    assert copies_of_handled(late, evidence, WINDOW, held=True)
    mixed = [fault_event(gpu=0, code=79, minutes=1), fault_event(gpu=1, code=79, minutes=1)]
    assert not copies_of_handled(mixed, evidence, WINDOW, held=True)  # one new fault: a new incident
    assert not copies_of_handled(late, [], WINDOW, held=True)


def _handled(store: Store, node: str, status: IncidentStatus, *actions: str) -> str:
    """An incident for one XID 79 on GPU 0 of `node` at T0, its actions carried out, ended with `status`."""
    event = fault_event(node=node, id=f"{node}-first", gpu=0, code=79)
    store.record_accepted([event])
    row, opened = store.open_or_join(incident(event, id=f"inc-{node}"), runner="a:serve-1:1", lease_s=30)
    assert opened
    for action in actions:
        key = f"{row.id}:{node}:{action}"
        store.claim_action(key, row.id, node, action)
        store.finish_action(key, ActionStatus.SUCCEEDED, f"{action} {node}")
    store.update_incident(
        row.id, status=status, closed_at=utcnow(), outcome=f"{status}: {', '.join(actions)}"
    )
    return row.id


def _arrives(store: Store, event: FaultEvent, id: str) -> tuple[str, bool]:
    store.record_accepted([event])
    row, opened = store.open_or_join(incident(event, id=id), runner="b:serve-2:2", lease_s=30, window=WINDOW)
    return row.id, opened


def test_copies_after_a_reboot_join_its_incident_and_a_new_fault_opens_one(store: Store) -> None:
    node = "gpu-node-1"
    handled = _handled(store, node, IncidentStatus.CLOSED, "drain", "reboot", "resume")
    before = store.get_incident(handled)
    assert before is not None

    for n, minutes in enumerate((2, 9, 17)):  # stamped when each copy was sent, every one within the window
        copy = fault_event(node=node, id=f"copy-{n}", gpu=0, code=79, minutes=minutes, message=f"resent {n}")
        assert _arrives(store, copy, f"inc-copy-{n}") == (handled, False)
    after = store.get_incident(handled)
    assert after is not None and (after.status, after.last_event_at) == (before.status, before.last_event_at)
    assert [e.id for e in store.incident_events(handled)] == [f"{node}-first", "copy-0", "copy-1", "copy-2"]
    assert store.get_incident("inc-copy-0") is None

    other_gpu = fault_event(node=node, id="gpu-5", gpu=5, code=79, minutes=18)
    assert _arrives(store, other_gpu, "inc-gpu-5") == ("inc-gpu-5", True)
    store.update_incident("inc-gpu-5", status=IncidentStatus.CLOSED, closed_at=utcnow())
    quiet = fault_event(node=node, id="again", gpu=0, code=79, minutes=17 + 11)  # a quiet window later
    assert _arrives(store, quiet, "inc-again") == ("inc-again", True)


def test_copies_of_a_fault_handed_to_people_join_it_and_a_harmless_one_is_judged_again(store: Store) -> None:
    escalated = _handled(store, "gpu-node-2", IncidentStatus.ESCALATED)  # nothing done: people have it
    copy = fault_event(node="gpu-node-2", id="esc-copy", gpu=0, code=79, minutes=5)
    assert _arrives(store, copy, "inc-esc-copy") == (escalated, False)

    _handled(store, "gpu-node-3", IncidentStatus.CLOSED)  # left alone
    repeat = fault_event(node="gpu-node-3", id="none-copy", gpu=0, code=79, minutes=5)
    assert _arrives(store, repeat, "inc-none-copy") == ("inc-none-copy", True)


def test_a_node_we_hold_keeps_its_faults_copies_however_late(store: Store) -> None:
    held = _handled(store, "gpu-node-4", IncidentStatus.ESCALATED, "drain")
    days_later = fault_event(node="gpu-node-4", id="held-copy", gpu=0, code=79, minutes=3 * 24 * 60)
    assert _arrives(store, days_later, "inc-held-copy") == (held, False)


def test_the_store_lists_the_nodes_we_hold_until_our_resume(store: Store) -> None:
    drained = _handled(store, "gpu-node-5", IncidentStatus.ESCALATED, "drain")
    _handled(store, "gpu-node-6", IncidentStatus.CLOSED, "drain", "reboot", "resume")
    rebooted = _handled(store, "gpu-node-7", IncidentStatus.ESCALATED, "drain", "reboot")
    holds = {(h.node, h.incident, h.action, h.incident_status) for h in store.held_nodes()}
    assert holds == {
        ("gpu-node-5", drained, "drain", "escalated"),
        ("gpu-node-7", rebooted, "reboot", "escalated"),
    }
    assert [h.node for h in store.held_nodes("gpu-node-7")] == ["gpu-node-7"]
    assert store.held_nodes("gpu-node-6") == []

    # A later incident's resume returns the node, whoever drained it.
    key = "inc-later:gpu-node-5:resume"
    store.claim_action(key, "inc-later", "gpu-node-5", "resume")
    store.finish_action(key, ActionStatus.SUCCEEDED, "resumed gpu-node-5")
    assert [h.node for h in store.held_nodes()] == ["gpu-node-7"]
    # A failed action holds nothing.
    key = "inc-x:gpu-node-8:drain"
    store.claim_action(key, "inc-x", "gpu-node-8", "drain")
    store.finish_action(key, ActionStatus.FAILED, "scontrol: error")
    assert "gpu-node-8" not in {h.node for h in store.held_nodes()}


def _straggler(node: str, id: str, minutes: float, cause: str | None) -> FaultEvent:
    verdict = {} if cause is None else {"straggler_cause": cause}
    return fault_event(
        "straggler",
        node=node,
        id=id,
        gpu=1,
        job="llm",
        rank=3,
        minutes=minutes,
        source="medic",
        attributes={"step_time_ratio": 1.6, "detector": "peer", **verdict},
    )


def test_a_straggler_whose_verdict_cleared_its_node_is_one_incident_while_it_stays_slow(store: Store) -> None:
    """docs/decisions/0024: its reports join the incident that left the node alone for that verdict;
    a verdict that blames the node, or none, is judged again, as every repeated fault is."""
    node = "gpu-node-2"
    first = _straggler(node, "s-0", 0, "software-python")
    store.record_accepted([first])
    row, opened = store.open_or_join(incident(first, id="inc-slow"), runner="a:serve-1:1", lease_s=30)
    assert opened
    store.update_incident(row.id, status=IncidentStatus.CLOSED, closed_at=utcnow(), outcome="none")
    for n, minutes in enumerate((1, 5, 12)):  # each within the window of the one before
        again = _straggler(node, f"s-{n + 1}", minutes, "software-python")
        assert _arrives(store, again, f"inc-s-{n + 1}") == ("inc-slow", False)
    assert _arrives(store, _straggler(node, "s-hw", 13, "hardware-compute"), "inc-hw") == ("inc-hw", True)
    store.update_incident("inc-hw", status=IncidentStatus.CLOSED, closed_at=utcnow(), outcome="none")
    assert _arrives(store, _straggler(node, "s-none", 14, None), "inc-none") == ("inc-none", True)
    store.update_incident("inc-none", status=IncidentStatus.CLOSED, closed_at=utcnow(), outcome="none")
    quiet = _straggler(node, "s-later", 40, "software-python")  # after a quiet window: a new episode
    assert _arrives(store, quiet, "inc-later") == ("inc-later", True)
