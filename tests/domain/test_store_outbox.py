"""The outbox's claims (medic/store/outbox.py): the pending messages of a process that is gone are
taken by one process, all of them together, each once, whoever else claims at the same moment; a live
process keeps its own. On SQLite and PostgreSQL."""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import socket
import subprocess
from datetime import timedelta

from audit_support import sql

from medic.statuses import MessageStatus, StepStatus
from medic.store import Store, utcnow
from medic.store.tables import StepRecord
from medic.tasks.runtime.runners import dead_runners, runner_name

ROLE = "notify"


def gone() -> str:
    """The name of a process of this host that has ended."""
    process = subprocess.Popen(["true"])
    process.wait()
    return f"{socket.gethostname()}:{ROLE}:{process.pid}"


def say(store: Store, owner: str, incident: str, replies: int, lease_s: float = 60) -> list[int]:
    """A message of its own and its replies, as a process says them."""
    head = store.queue_message(
        incident, "notify", message={"title": incident}, text="", parent_id=None, owner=owner, lease_s=lease_s
    )
    return [head] + [
        store.queue_message(
            incident, "update", message=None, text=f"r{n}", parent_id=head, owner=owner, lease_s=lease_s
        )
        for n in range(replies)
    ]


def _claim(
    url: str,
    start: multiprocessing.synchronize.Barrier,
    out: multiprocessing.queues.Queue[list[tuple[int | None, str]]],
) -> None:
    store = Store(url)
    me = runner_name(ROLE)
    start.wait()
    claimed = store.claim_messages(me, 60, dead_runners(store.message_owners(), me))
    out.put([(row.id, row.incident_id) for row in claimed])
    store.close()


def test_two_processes_claiming_a_dead_processs_messages_take_each_once(store: Store) -> None:
    said = {incident: say(store, gone(), incident, replies=5) for incident in ("inc-a", "inc-b", "inc-c")}
    alive = say(store, runner_name(ROLE), "inc-mine", replies=2)  # this process's: not taken

    context = multiprocessing.get_context("spawn")
    start, out = context.Barrier(2), context.Queue()
    claimers = [context.Process(target=_claim, args=(store.url, start, out)) for _ in range(2)]
    for claimer in claimers:
        claimer.start()
    taken = [out.get(timeout=120) for _ in claimers]
    for claimer in claimers:
        claimer.join(60)
        assert claimer.exitcode == 0

    ids = [row for claimed in taken for row, _ in claimed]
    assert sorted(ids) == sorted(i for rows in said.values() for i in rows)  # each once
    for claimed in taken:  # a message and its replies go on with one process, in the order said
        for incident, rows in said.items():
            mine = [row for row, of in claimed if of == incident]
            assert mine in ([], rows)
    assert not set(ids) & set(alive)


def test_a_lapsed_hold_is_claimed_and_a_held_one_is_not(store: Store) -> None:
    lapsed = say(store, "other-host:notify:41", "inc-lapsed", replies=1, lease_s=-1)
    held = say(store, "other-host:notify:42", "inc-held", replies=1)
    me = runner_name(ROLE)

    claimed = store.claim_messages(me, 60)

    assert [row.id for row in claimed] == lapsed
    assert {row.owner for row in claimed} == {me}
    assert all(row.lease_until is not None and row.lease_until > utcnow() for row in claimed)
    assert store.claim_messages(runner_name(ROLE), 60) == []  # now held by this process
    assert {row.owner for row in store.messages(held)} == {"other-host:notify:42"}


def test_a_settled_message_is_not_claimed_and_its_step_is_written_with_it(store: Store) -> None:
    owner = gone()
    head, reply = say(store, owner, "inc-settled", replies=1)
    step = StepRecord(
        incident_id="inc-settled",
        stage="notify",
        started_at=utcnow() - timedelta(seconds=1),
        finished_at=utcnow(),
        status=StepStatus.OK,
        summary="posted to #gpu-ops (thread C1:1)",
    )
    store.settle_message(head, MessageStatus.DELIVERED, tries=2, error="", ref="C1:1", step=step)

    claimed = store.claim_messages(runner_name(ROLE), 60, {owner})

    assert [row.id for row in claimed] == [reply]
    (settled,) = store.messages([head])
    assert (settled.status, settled.tries, settled.ref) == (MessageStatus.DELIVERED, 2, "C1:1")
    assert settled.settled_at is not None
    assert (
        sql(store, "SELECT status FROM steps WHERE incident_id = 'inc-settled' AND stage = 'notify'") == "ok"
    )
    assert store.verify_chain().ok
