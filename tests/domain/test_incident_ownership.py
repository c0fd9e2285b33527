"""One incident per node at a time, one run per incident: the store enforces it across processes.

Replicas (or an ingest beside them) opening incidents for one node at once get one between them,
and the losers' events join it; a run holds its incident's lease, and an incident whose run died
is picked up by exactly one process (on SQLite and PostgreSQL).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.synchronize
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from factories import fault_event, incident
from sqlalchemy import create_engine, text
from sqlmodel import select

from medic.events import FaultEvent
from medic.flows.leases import Leases, runner_name
from medic.flows.live import LiveDispatcher
from medic.integrations.sim.fleet import SimFleet
from medic.policy.model import Action, Classification, Decision
from medic.statuses import ACTIVE_INCIDENT_STATUSES, ActStatus, IncidentStatus
from medic.store import Store, utcnow
from medic.store.tables import ACTIVE_SQL, EventRecord, IncidentRecord
from medic.tasks.act import act
from medic.tasks.runtime.process import Runtime

OPENERS = 4
EACH = 10


def test_the_partial_index_names_every_active_status() -> None:
    assert all(f"'{status.value}'" in ACTIVE_SQL for status in ACTIVE_INCIDENT_STATUSES)
    assert ACTIVE_SQL.count("'") == 2 * len(ACTIVE_INCIDENT_STATUSES)


def _open_for_one_node(url: str, start: multiprocessing.synchronize.Barrier, out: dict[str, bool]) -> None:
    store = Store(url)
    start.wait()
    for n in range(EACH):
        event = fault_event(node="gpu-node-1", id=f"e-{os.getpid()}-{n}")
        store.record_accepted([event])
        _, opened = store.open_or_join(
            incident(event, id=f"inc-{os.getpid()}-{n}"), runner=f"r:{os.getpid()}", lease_s=30
        )
        out[f"{os.getpid()}-{n}"] = opened
    store.close()


def test_replicas_opening_incidents_for_one_node_at_once_get_one(store: Store) -> None:
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(OPENERS)
    with context.Manager() as manager:
        out = manager.dict()
        openers = [
            context.Process(target=_open_for_one_node, args=(store.url, start, out)) for _ in range(OPENERS)
        ]
        for process in openers:
            process.start()
        for process in openers:
            process.join(60)
            assert process.exitcode == 0
        opened = sum(out.values())

    with store.session() as s:
        incidents = s.exec(select(IncidentRecord)).all()
        events = s.exec(select(EventRecord)).all()
    assert opened == 1
    assert len(incidents) == 1
    assert len(events) == OPENERS * EACH
    assert {e.incident_id for e in events} == {incidents[0].id}


def test_evidence_after_the_window_joins_the_incident_still_being_handled(store: Store) -> None:
    first = fault_event(node="gpu-node-2", id="w-1")
    store.record_accepted([first])
    _, opened = store.open_or_join(incident(first, id="inc-w"), runner="a:serve-1:1", lease_s=30)
    assert opened
    store.update_incident("inc-w", status=IncidentStatus.REMEDIATING)  # a long L3 runs meanwhile

    late = fault_event(node="gpu-node-2", id="w-2", minutes=180)
    store.record_accepted([late])
    joined, opened = store.open_or_join(incident(late, id="inc-late"), runner="b:serve-2:2", lease_s=30)

    assert not opened and joined.id == "inc-w"
    assert [e.id for e in store.incident_events("inc-w")] == ["w-1", "w-2"]
    assert store.get_incident("inc-w").last_event_at == late.time  # type: ignore[union-attr]
    assert store.get_incident("inc-late") is None


def test_evidence_stored_while_an_incident_was_active_joins_it_after_it_ended(store: Store) -> None:
    """A replica that stored a duplicate while the node's incident was handled, but correlated it only
    after that incident ended (its scheduler call hung through the node's reboot), joins the ended
    incident: a second one would act on the node again for the same fault. Evidence stored after the
    end opens a new incident."""
    first = fault_event(node="gpu-node-4", id="e-1")
    store.record_accepted([first])
    store.open_or_join(incident(first, id="inc-e"), runner="a:serve-1:1", lease_s=30)
    duplicate = fault_event(node="gpu-node-4", id="e-2", minutes=1)
    store.record_accepted([duplicate])  # stored now, correlated only after the close below
    store.update_incident("inc-e", status=IncidentStatus.CLOSED, closed_at=utcnow())

    joined, opened = store.open_or_join(incident(duplicate, id="inc-dup"), runner="b:serve-2:2", lease_s=30)

    assert not opened and joined.id == "inc-e"
    assert [e.id for e in store.incident_events("inc-e")] == ["e-1", "e-2"]
    assert store.get_incident("inc-dup") is None

    recurrence = fault_event(node="gpu-node-4", id="e-3", minutes=30)
    store.record_accepted([recurrence])
    row, opened = store.open_or_join(incident(recurrence, id="inc-again"), runner="b:serve-2:2", lease_s=30)
    assert opened and row.id == "inc-again"


def test_a_handled_incident_is_not_opened_again_and_a_failed_one_runs_again(store: Store) -> None:
    event = fault_event(node="gpu-node-3", id="h-1")
    store.record_accepted([event])
    store.open_or_join(incident(event, id="inc-h"), runner="a:x:1", lease_s=30)
    store.update_incident("inc-h", status=IncidentStatus.CLOSED)
    _, opened = store.open_or_join(incident(event, id="inc-h"), runner="a:x:1", lease_s=30)
    assert not opened

    store.update_incident("inc-h", status=IncidentStatus.FAILED)
    row, opened = store.open_or_join(incident(event, id="inc-h"), runner="b:x:2", lease_s=30)
    assert opened and row.status == IncidentStatus.OPEN and row.runner == "b:x:2"


def test_a_held_lease_is_refused_a_lapsed_one_taken_by_one_claimer(store: Store) -> None:
    event = fault_event(node="gpu-node-4", id="l-1")
    store.record_accepted([event])
    store.open_or_join(incident(event, id="inc-l"), runner="host:serve-1:1", lease_s=30)

    assert not store.claim_incident("inc-l", "host:serve-2:2", lease_s=30)
    assert store.renew_leases("host:serve-1:1", ["inc-l"], lease_s=30) == 1
    assert store.renew_leases("host:serve-2:2", ["inc-l"], lease_s=30) == 0
    # Its holder is known dead (a predecessor on this host and port): taken back at once.
    assert store.claim_incident("inc-l", "host:serve-1:9", lease_s=30, dead=["host:serve-1:1"])

    store.update_incident("inc-l", lease_until=store.get_incident("inc-l").opened_at)  # type: ignore[union-attr]
    claims = [store.claim_incident("inc-l", f"host:serve-{n}:{n}", lease_s=30) for n in (3, 4)]
    assert claims == [True, False]
    assert [r.id for r in store.orphaned_incidents()] == []


def test_a_runner_of_this_host_and_role_whose_process_is_gone_is_dead(store: Store) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(gone.stdout)
    me = Leases(store, runner_name("serve-7000"))
    host = me.runner.split(":")[0]
    for n, runner in enumerate(
        [f"{host}:serve-7000:{dead_pid}", f"{host}:serve-7000:{os.getpid()}", f"{host}:serve-7001:{dead_pid}"]
    ):
        event = fault_event(node=f"gpu-node-{n + 1}", id=f"d-{n}")
        store.record_accepted([event])
        store.open_or_join(incident(event, id=f"inc-d{n}"), runner=runner, lease_s=600)

    assert me.dead_runners() == {f"{host}:serve-7000:{dead_pid}"}
    assert [r.id for r in me.pickup()] == ["inc-d0"]
    assert me.held() == {"inc-d0"}
    me.close()


def test_a_closed_dispatcher_stops_renewing_and_its_incident_lapses_for_a_replica(runtime: Runtime) -> None:
    store = runtime.store
    event = fault_event(node="gpu-node-7", id="c-1")
    store.record_accepted([event])
    lease_s = 1.5
    mine = Leases(store, "here:serve-1:1", lease_s=lease_s)
    store.open_or_join(incident(event, id="inc-c"), runner=mine.runner, lease_s=lease_s)
    mine.hold("inc-c")

    def lease_until() -> object:
        return store.get_incident("inc-c").lease_until  # type: ignore[union-attr]

    first = lease_until()
    time.sleep(lease_s)  # more than one renewal (every third of a lease)
    renewed = lease_until()
    assert renewed != first  # held: renewed while the run goes on
    assert not store.claim_incident("inc-c", "there:serve-2:2", lease_s=lease_s)

    started = time.monotonic()
    LiveDispatcher(runtime, mine).close()
    assert time.monotonic() - started < lease_s  # it waits for the renewer to end, no longer
    time.sleep(lease_s * 1.5)
    assert store.claim_incident("inc-c", "there:serve-2:2", lease_s=lease_s)  # lapsed: a replica takes it


def _run_died(runtime: Runtime, incident_id: str, event: FaultEvent) -> None:
    """An incident opened and remediating on another host, whose process died: its lease lapsed."""
    runtime.store.record_accepted([event])
    runtime.store.open_or_join(incident(event, id=incident_id), runner="elsewhere:serve-1:1", lease_s=30)
    runtime.store.update_incident(
        incident_id,
        status=IncidentStatus.REMEDIATING,
        lease_until=runtime.store.get_incident(incident_id).opened_at,  # type: ignore[union-attr]
    )


def test_an_incident_whose_run_died_is_picked_up_and_finished(
    runtime: Runtime, live_dispatcher: Callable[..., LiveDispatcher]
) -> None:
    _run_died(runtime, "inc-p", fault_event(kind="xid", node="gpu-node-5", id="p-1"))
    dispatcher = live_dispatcher(runtime, Leases(runtime.store, runner_name("serve-7002")))

    async def pick_up() -> int:
        found = await dispatcher.pickup()
        await dispatcher.drain()
        return found

    assert asyncio.run(pick_up()) == 1
    record = runtime.store.get_incident("inc-p")
    assert record is not None and record.status in (IncidentStatus.CLOSED, IncidentStatus.ESCALATED)
    assert dispatcher.leases.held() == set()


def test_a_store_written_by_an_earlier_release_gains_the_lease_columns(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(
            text(
                "CREATE TABLE incidents (id VARCHAR PRIMARY KEY, node VARCHAR NOT NULL, scope VARCHAR NOT NULL, "
                "switch VARCHAR, opened_at DATETIME NOT NULL, last_event_at DATETIME NOT NULL, "
                "closed_at DATETIME, status VARCHAR NOT NULL, jobs JSON, owner VARCHAR, classification VARCHAR, "
                "action VARCHAR, rule VARCHAR, outcome TEXT, flow_run_id VARCHAR, flow_run_name VARCHAR)"
            )
        )
    engine.dispose()

    store = Store(url)
    event = fault_event(node="gpu-node-1", id="o-1")
    store.record_accepted([event])
    _, opened = store.open_or_join(incident(event, id="inc-o"), runner="a:b:1", lease_s=30)
    assert opened and store.get_incident("inc-o").runner == "a:b:1"  # type: ignore[union-attr]
    store.close()


def test_a_new_fault_on_a_node_whose_run_died_claims_its_incident(
    runtime: Runtime, live_dispatcher: Callable[..., LiveDispatcher]
) -> None:
    _run_died(runtime, "inc-n", fault_event(kind="xid", node="gpu-node-6", id="n-1"))
    dispatcher = live_dispatcher(runtime, Leases(runtime.store, runner_name("serve-7003")))
    second = fault_event(kind="xid", node="gpu-node-6", id="n-2", minutes=1)
    runtime.store.record_accepted([second])

    async def deliver() -> None:
        await dispatcher([second])
        await dispatcher.drain()

    asyncio.run(deliver())
    record = runtime.store.get_incident("inc-n")
    assert record is not None and record.status in (IncidentStatus.CLOSED, IncidentStatus.ESCALATED)
    assert record.runner == dispatcher.leases.runner
    assert [e.id for e in runtime.store.incident_events("inc-n")] == ["n-1", "n-2"]


def _reboot(incident_id: str) -> Decision:
    return Decision(
        incident=incident_id,
        classification=Classification.HARDWARE,
        action=Action.REBOOT,
        rule="r",
        reason="-",
    )


def _opened(runtime: Runtime, incident_id: str, event: FaultEvent) -> None:
    runtime.store.record_accepted([event])
    runtime.store.open_or_join(incident(event, id=incident_id), runner="t:x:1", lease_s=30)


def test_a_fault_a_reboot_already_followed_is_not_rebooted_again(runtime: Runtime, fleet: SimFleet) -> None:
    node = "gpu-node-7"
    _opened(runtime, "inc-e1", fault_event(node=node, id="e1-1"))
    first = act.fn("inc-e1", node, 0, _reboot("inc-e1"))
    assert first.status == ActStatus.DONE, first.detail
    runtime.store.update_incident("inc-e1", status=IncidentStatus.CLOSED)
    assert fleet.nodes[node].boots == 1

    # A copy of the fault joins the incident that rebooted the node (docs/decisions/0013): nothing to cover.
    copy = fault_event(node=node, id="e1-copy", at=utcnow() - timedelta(minutes=1))
    runtime.store.record_accepted([copy])
    joined, opened = runtime.store.open_or_join(incident(copy, id="inc-copy"), runner="t:x:1", lease_s=30)
    assert (joined.id, opened) == ("inc-e1", False)

    # Evidence before the reboot that does reach a second incident (another GPU's, which the first
    # incident never saw): the reboot covers it.
    late = fault_event(node=node, id="e1-2", gpu=1, at=utcnow() - timedelta(minutes=1))
    _opened(runtime, "inc-e2", late)
    covered = act.fn("inc-e2", node, 0, _reboot("inc-e2"))
    assert covered.status == ActStatus.ALREADY_DONE and "incident inc-e1" in covered.detail
    assert fleet.nodes[node].boots == 1
    runtime.store.update_incident("inc-e2", status=IncidentStatus.CLOSED)

    # The node faults again after the reboot: a new episode, for the policy to judge (here the
    # node's cooldown holds it; the episode check does not).
    again = fault_event(node=node, id="e1-3", gpu=2, at=utcnow() + timedelta(seconds=1))
    _opened(runtime, "inc-e3", again)
    third = act.fn("inc-e3", node, 0, _reboot("inc-e3"))
    assert third.status == ActStatus.ESCALATED and "guardrail node_cooldown" in third.detail
    assert fleet.nodes[node].boots == 1
