"""Group commit (medic/apps/server/group_commit.py): requests that arrive while a commit runs are stored
together by the next, each answered once its own events are durable, a duplicate across them
answered as one, and a request whose events cannot be stored failing alone."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

from factories import fault_event

from medic.apps.server.group_commit import GroupCommit
from medic.events import FaultEvent
from medic.store import Store

REQUESTS = 16


def xid(event_id: str) -> FaultEvent:
    return fault_event("xid", id=event_id, node="gpu-node-1", at=datetime.now(UTC), code=79)


def at_once(grouped: GroupCommit, bodies: list[list[FaultEvent]]) -> list[list[FaultEvent] | BaseException]:
    """Each body recorded from its own thread, all released together."""
    start = threading.Barrier(len(bodies))
    answers: list[list[FaultEvent] | BaseException] = [[] for _ in bodies]

    def send(index: int) -> None:
        start.wait()
        try:
            answers[index] = grouped.record(bodies[index])
        except BaseException as error:  # what each request would answer
            answers[index] = error

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def slowly(store: Store, poison: str | None = None) -> GroupCommit:
    """A group commit on the real store whose commits take long enough for the rest to queue."""

    def record(events: list[FaultEvent]) -> list[FaultEvent]:
        time.sleep(0.3)
        if any(e.id == poison for e in events):
            raise ValueError(f"{poison} cannot be stored")
        return store.record_accepted(events)

    return GroupCommit(record)


def test_requests_waiting_on_a_commit_are_stored_together(store: Store) -> None:
    grouped = slowly(store)
    bodies = [[xid(f"group-{i}")] for i in range(REQUESTS)]
    answers = at_once(grouped, bodies)
    assert answers == bodies  # each request answered with its own event, stored
    assert store.known_event_ids(f"group-{i}" for i in range(REQUESTS)) == {
        f"group-{i}" for i in range(REQUESTS)
    }
    assert grouped.commits < REQUESTS // 2  # the first alone, then the ones that queued behind it


def test_one_event_in_two_requests_of_a_batch_is_new_to_one_only(store: Store) -> None:
    grouped = slowly(store)
    same = xid("group-twice")
    answers = at_once(grouped, [[same], [same], [xid("group-other")]])
    assert sorted(len(a) for a in answers if isinstance(a, list)) == [0, 1, 1]
    assert store.known_event_ids(["group-twice", "group-other"]) == {"group-twice", "group-other"}


def test_a_request_that_cannot_be_stored_fails_alone(store: Store) -> None:
    grouped = slowly(store, poison="group-poison")
    bodies = [[xid(f"group-ok-{i}")] for i in range(REQUESTS - 1)] + [[xid("group-poison")]]
    answers = at_once(grouped, bodies)
    assert isinstance(answers[-1], ValueError)
    assert answers[:-1] == bodies[:-1]
    assert "group-poison" not in store.known_event_ids(["group-poison"])


def test_a_store_that_is_down_acknowledges_nothing() -> None:
    def down(events: list[FaultEvent]) -> list[FaultEvent]:
        time.sleep(0.1)
        raise ConnectionError("the store does not answer")

    answers = at_once(GroupCommit(down), [[xid(f"group-down-{i}")] for i in range(4)])
    assert all(isinstance(a, ConnectionError) for a in answers)


class Stopped(BaseException):
    """Not an Exception: nothing tries the batch again request by request."""


def test_a_commit_stopped_by_more_than_an_error_acknowledges_none_of_its_requests() -> None:
    def stops_batches(events: list[FaultEvent]) -> list[FaultEvent]:
        time.sleep(0.3)
        if len(events) > 1:
            raise Stopped
        return events

    answers = at_once(GroupCommit(stops_batches), [[xid(f"group-stop-{i}")] for i in range(4)])
    assert sum(isinstance(a, list) and len(a) == 1 for a in answers) == 1  # the first, alone
    assert sum(isinstance(a, Stopped) for a in answers) == 1  # the thread that committed the rest
    assert sum(isinstance(a, RuntimeError) for a in answers) == 2  # theirs: not committed
