"""The circuit breaker in the store: a trip is saved wherever a check finds it, and replicas
opening it at once make one open row (a unique partial index, on SQLite and PostgreSQL)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os

from sqlmodel import col, select

from medic.policy.model import Action, Classification, Decision
from medic.statuses import ActionStatus
from medic.store import Store
from medic.store.tables import BreakerRecord
from medic.tasks.nodes.guard import guarded
from medic.tasks.runtime.process import Runtime

OPENERS = 4
TRIES = 25


def reboot() -> Decision:
    return Decision(
        incident="inc-trip",
        classification=Classification.HARDWARE,
        action=Action.REBOOT,
        rule="r",
        reason="rule r",
    )


def test_a_trip_found_at_the_last_check_opens_the_breaker(runtime: Runtime) -> None:
    # The default policy trips at 25% of the 8 simulated nodes within 5 min: two are out already.
    for node in ("node-1", "node-2"):
        runtime.store.claim_action(f"inc-{node}:{node}:drain", f"inc-{node}", node, "drain")
        runtime.store.finish_action(f"inc-{node}:{node}:drain", ActionStatus.SUCCEEDED, "drained")
    assert runtime.store.open_breaker_record() is None

    with guarded(runtime, "node-3", reboot()) as stopped:
        assert stopped is not None and stopped[0] == "circuit_breaker"

    opened = runtime.store.open_breaker_record()
    assert opened is not None
    assert opened.incident_id == "inc-trip"
    assert opened.reason == stopped[1]


def _open_many(url: str, start: multiprocessing.synchronize.Barrier) -> None:
    store = Store(url)
    start.wait()
    for n in range(TRIES):
        store.open_breaker(f"storm seen by {os.getpid()} #{n}")
    store.close()


def test_replicas_opening_the_breaker_at_once_make_one_open_row(store: Store) -> None:
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(OPENERS)
    openers = [context.Process(target=_open_many, args=(store.url, start)) for _ in range(OPENERS)]
    for process in openers:
        process.start()
    for process in openers:
        process.join(60)
        assert process.exitcode == 0

    with store.session() as s:
        open_rows = s.exec(select(BreakerRecord).where(col(BreakerRecord.closed_at).is_(None))).all()
    assert len(open_rows) == 1
    closed = store.close_breaker("sre@example.com")
    assert closed is not None and closed.id == open_rows[0].id
    assert store.open_breaker_record() is None
