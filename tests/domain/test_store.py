"""The audit and incident store (medic/store): every test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import multiprocessing
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from threading import Barrier, Timer
from typing import Any

import pytest
from factories import T0, fault_event, incident
from sqlalchemy import text

from medic.context import Around
from medic.events import EventKind, FaultEvent
from medic.incidents import correlate
from medic.intake import Rejection, parse_line
from medic.policy.model import Action, Classification, Decision
from medic.store import Store
from medic.store.tables import ActionRecord, DiagnosticRecord, EventRecord, IncidentRecord


def ev(event_id: str, minutes: float = 0, **fields: Any) -> FaultEvent:
    """On gpu-017, xid 79 unless `kind=` says otherwise (a remediation is a drain)."""
    return fault_event(id=event_id, minutes=minutes, **fields)


# --- events ---------------------------------------------------------------------------------


def test_record_events_stores_each_event_once_with_its_incident(store: Store) -> None:
    incidents = correlate(
        [ev("a1", 0), ev("a2", 1), ev("b1", 0, node="gpu-002"), ev("a3", 60)], timedelta(minutes=10)
    )
    assert len(incidents) == 3
    assert store.record_events(incidents) == 4
    assert store.count(EventRecord) == 4
    with store.session() as s:
        owner = {r.id: r.incident_id for r in s.exec(text("SELECT id, incident_id FROM events"))}
    assert owner == {e.id: i.id for i in incidents for e in i.events}

    # Replaying the same input stores nothing and changes nothing.
    assert store.record_events(incidents) == 0
    assert store.count(EventRecord) == 4
    # A mix of old and new stores only the new.
    assert store.record_events([incident(ev("a1"), ev("c1", 2))]) == 1
    assert store.count(EventRecord) == 5


def test_known_event_ids_beyond_one_chunk(store: Store) -> None:
    events = [ev(f"ev-{n:04}", minutes=n / 1000) for n in range(1203)]
    assert store.record_events([incident(*events)]) == 1203
    asked = [e.id for e in events] + [f"missing-{n}" for n in range(300)]
    assert store.known_event_ids(asked) == {e.id for e in events}
    assert store.known_event_ids(reversed(asked[1100:1400])) == {e.id for e in events[1100:]}
    assert store.known_event_ids([]) == set()


def test_incident_events_rebuild_the_original_events(store: Store) -> None:
    events = [
        ev(
            "x1",
            0,
            gpu=3,
            job="train-7",
            rank=12,
            iteration=2**40,
            switch="leaf-4",
            attributes={"code": 79, "message": "fell off the bus", "pci": {"bus": "0000:3b:00.0", "n": None}},
        ),
        ev("x2", 1, kind="ecc", attributes={"dbe": 2, "sbe": 17}),
        ev(
            "x3",
            2,
            kind="straggler",
            job="train-7",
            rank=3,
            attributes={"step_time_ratio": 1.3333333333333333},
        ),
        ev("x4", 3, kind="nccl_timeout"),
    ]
    (inc,) = correlate(events)
    store.record_events([inc])
    rebuilt = store.incident_events(inc.id)
    assert rebuilt == events
    assert [e.attributes for e in rebuilt] == [e.attributes for e in events]
    assert rebuilt[0].attributes["pci"] == {"bus": "0000:3b:00.0", "n": None}
    assert all(e.time.tzinfo is not None and e.time.utcoffset() == timedelta(0) for e in rebuilt)
    assert store.incident_events("inc-nope") == []


# --- time ------------------------------------------------------------------------------------


def test_aware_datetimes_round_trip_exactly_in_utc(store: Store) -> None:
    ist = timezone(timedelta(hours=5, minutes=30))
    closed = datetime(2025, 3, 1, 17, 30, 0, 123456, tzinfo=ist)
    store.open_incident(incident(ev("t1", 0), id="inc-t"))
    store.update_incident("inc-t", closed_at=closed)
    store.add_step("inc-t", "diagnose", closed, "ok", "")

    got = store.get_incident("inc-t")
    assert got is not None
    detail = store.incident_detail("inc-t")
    assert detail is not None
    for value in (got.closed_at, detail.steps[0].started_at):
        assert value == datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)  # the same instant, to the µs
        assert value.tzinfo is not None and value.utcoffset() == timedelta(0)  # handed back in UTC
    assert got.opened_at == T0 and got.opened_at.utcoffset() == timedelta(0)
    # Times compare as instants in queries too, whatever offset they were given with.
    assert [r.id for r in store.find_incidents(since=T0.astimezone(ist))] == ["inc-t"]
    assert store.find_incidents(since=(T0 + timedelta(microseconds=1)).astimezone(ist)) == []


def test_a_naive_datetime_is_refused(store: Store) -> None:
    naive = datetime(2025, 3, 1, 12, 0)
    with pytest.raises(Exception, match="naive datetime"):
        store.add_step("inc-n", "diagnose", naive, "ok", "")
    with pytest.raises(Exception, match="naive datetime"):
        store.node_history("gpu-017", naive)
    assert store.count(IncidentRecord) == 0


# --- the dead letter -------------------------------------------------------------------------


def test_rejections_keep_origin_raw_text_and_reason(store: Store) -> None:
    bad = [
        parse_line('{"id": "e1", "kind": "xid"', "events.jsonl:3"),
        parse_line("[1, 2]", "events.jsonl:9"),
        Rejection("webhook", "x" * 5000 + " ünïcode ✓", "line longer than it should be"),
    ]
    assert all(isinstance(r, Rejection) for r in bad)
    assert store.record_rejections(bad) == 3
    assert store.record_rejections([]) == 0
    kept = store.rejections()
    assert [(r.origin, r.raw, r.reason) for r in kept] == [(r.origin, r.raw, r.reason) for r in bad]
    assert all(r.received_at.tzinfo is not None for r in kept)


def test_a_rejected_line_with_a_nul_byte_is_still_kept(store: Store) -> None:
    # PostgreSQL text cannot hold NUL; a binary line must not take the dead letter down with it.
    bad = parse_line('{"id": "a\x00b"}', "events.jsonl:1")
    assert isinstance(bad, Rejection)
    assert store.record_rejections([bad]) == 1
    (kept,) = store.rejections()
    assert kept.origin == "events.jsonl:1"
    assert kept.raw == '{"id": "a\ufffdb"}'
    assert kept.reason == bad.reason


# --- incidents -------------------------------------------------------------------------------


def test_open_incident_creates_then_refreshes(store: Store) -> None:
    first = incident(ev("o1", 0, job="job-b"), ev("o2", 5, job="job-a"), id="inc-o")
    row = store.open_incident(first, owner="team-llm")
    assert (row.id, row.node, row.status, row.owner) == ("inc-o", "gpu-017", "open", "team-llm")
    assert (row.opened_at, row.last_event_at, row.jobs) == (T0, T0 + timedelta(minutes=5), ["job-a", "job-b"])

    # Newer events with a new job: merged. An older batch never moves last_event_at back.
    store.open_incident(incident(ev("o3", 9, job="job-c"), id="inc-o"), owner="someone-else")
    store.open_incident(incident(ev("o0", -3, job="job-a"), id="inc-o"))
    got = store.get_incident("inc-o")
    assert got is not None
    assert got.last_event_at == T0 + timedelta(minutes=9)
    assert got.opened_at == T0
    assert got.jobs == ["job-a", "job-b", "job-c"]
    assert got.owner == "team-llm"
    assert store.count(IncidentRecord) == 1


def test_update_and_get_incident(store: Store) -> None:
    store.open_incident(incident(ev("u1"), id="inc-u"))
    row = store.update_incident(
        "inc-u", status="closed", action="reboot", outcome="rebooted; dcgm level 1 passed"
    )
    assert (row.status, row.action) == ("closed", "reboot")
    got = store.get_incident("inc-u")
    assert got is not None
    assert (got.status, got.action, got.outcome) == ("closed", "reboot", "rebooted; dcgm level 1 passed")
    assert store.get_incident("inc-missing") is None
    with pytest.raises(KeyError):
        store.update_incident("inc-missing", status="closed")


def test_find_incidents(store: Store) -> None:
    # inc-1: gpu-001 then (same incident) gpu-002; inc-2: gpu-002 alone; inc-3: gpu-003, later.
    one = incident(
        ev("f1", 0, node="gpu-001", job="job-a"),
        ev("f2", 1, node="gpu-002", job="job-b"),
        id="inc-1",
    )
    two = incident(ev("f3", 30, node="gpu-002"), id="inc-2")
    three = incident(ev("f4", 90, node="gpu-003", job="job-a"), id="inc-3")
    store.record_events([one, two, three])
    store.record_history([ev("h1", 5, node="gpu-009", kind="remediation")])  # no incident
    store.open_incident(one, owner="team-a")
    store.open_incident(two, owner="team-b")
    store.open_incident(three, owner="team-a")

    def ids(**query: Any) -> list[str]:
        return [r.id for r in store.find_incidents(**query)]

    assert ids() == ["inc-3", "inc-2", "inc-1"]  # newest first
    assert ids(node="gpu-001") == ["inc-1"]
    assert ids(node="gpu-002") == ["inc-2", "inc-1"]  # any event's node, not just the first
    assert ids(node="gpu-009") == []
    assert ids(job="job-a") == ["inc-3", "inc-1"]
    assert ids(job="job-b") == ["inc-1"]
    assert ids(owner="team-a") == ["inc-3", "inc-1"]
    assert ids(owner="team-c") == []
    assert ids(since=T0 + timedelta(minutes=30)) == ["inc-3", "inc-2"]
    assert ids(since=T0 + timedelta(minutes=31)) == ["inc-3"]
    assert ids(node="gpu-002", owner="team-b") == ["inc-2"]
    assert ids(limit=1) == ["inc-3"]


# --- what each stage did -------------------------------------------------------------------


def test_incident_detail_returns_everything_in_order(store: Store) -> None:
    (inc,) = correlate([ev("d1", 0), ev("d2", 2, kind="ecc", attributes={"dbe": 1})])
    store.open_incident(inc)
    store.record_events([inc])
    store.add_step(inc.id, "triage", T0, "ok", "xid 79", detail={"facts": ["xid:79"]})
    store.add_step(inc.id, "diagnose", T0 + timedelta(minutes=1), "failed", "dcgm level 2 failed")
    store.add_diagnostic(
        DiagnosticRecord(
            incident_id=inc.id,
            node="gpu-017",
            level=2,
            result="fail",
            error_ids=["DCGM_FR_XID_ERROR"],
            started_at=T0,
            finished_at=T0 + timedelta(minutes=3),
            detail="xid 79 during diag",
        )
    )
    decision = Decision(
        incident=inc.id,
        classification=Classification.HARDWARE,
        action=Action.REBOOT,
        rule="xid-79-fell-off-bus",
        reason="XID 79: the GPU fell off the bus",
        recommend=["check the riser"],
        matched=["xid-79-fell-off-bus", "any-xid"],
        policy_sha256="ab" * 32,
    )
    store.add_decision(decision, "policies/default.yaml")
    store.claim_action(f"{inc.id}:gpu-017:reboot", inc.id, "gpu-017", "reboot")
    # Another incident's rows stay out of this one's detail.
    store.add_step("inc-other", "triage", T0, "ok", "")
    store.add_decision(decision.model_copy(update={"incident": "inc-other"}), "policies/default.yaml")

    detail = store.incident_detail(inc.id)
    assert detail is not None
    assert detail.incident.id == inc.id
    assert [e.id for e in detail.events] == ["d1", "d2"]
    assert [(s.stage, s.status, s.summary) for s in detail.steps] == [
        ("triage", "ok", "xid 79"),
        ("diagnose", "failed", "dcgm level 2 failed"),
    ]
    assert detail.steps[0].detail == {"facts": ["xid:79"]}
    assert detail.steps[0].finished_at >= detail.steps[0].started_at
    (diag,) = detail.diagnostics
    assert (diag.level, diag.result, diag.error_ids, diag.detail) == (
        2,
        "fail",
        ["DCGM_FR_XID_ERROR"],
        "xid 79 during diag",
    )
    (dec,) = detail.decisions
    assert dec.policy_sha256 == "ab" * 32
    assert dec.policy_path == "policies/default.yaml"
    assert (dec.rule, dec.reason) == ("xid-79-fell-off-bus", "XID 79: the GPU fell off the bus")
    assert dec.matched == ["xid-79-fell-off-bus", "any-xid"]
    assert (dec.classification, dec.action, dec.recommend) == ("hardware", "reboot", ["check the riser"])
    assert [(a.action, a.status) for a in detail.actions] == [("reboot", "intent")]
    assert store.incident_detail("inc-missing") is None


# --- actions ---------------------------------------------------------------------------------


def test_claim_action_once_then_finish(store: Store) -> None:
    row, fresh = store.claim_action("inc-a:gpu-017:reboot", "inc-a", "gpu-017", "reboot")
    assert fresh
    assert (row.status, row.attempts, row.finished_at) == ("intent", 0, None)
    assert row.intent_at.tzinfo is not None

    again, fresh_again = store.claim_action("inc-a:gpu-017:reboot", "inc-b", "gpu-099", "replace")
    assert not fresh_again
    assert (again.id, again.incident_id, again.node, again.action) == (row.id, "inc-a", "gpu-017", "reboot")
    assert store.count(ActionRecord) == 1

    done = store.finish_action("inc-a:gpu-017:reboot", "succeeded", detail="back in 212 s", attempts=2)
    assert (done.status, done.detail, done.attempts) == ("succeeded", "back in 212 s", 2)
    assert done.finished_at is not None and done.finished_at >= row.intent_at
    _, fresh_after = store.claim_action("inc-a:gpu-017:reboot", "inc-a", "gpu-017", "reboot")
    assert not fresh_after


def test_a_failed_claim_is_taken_back_once_to_try_again(store: Store) -> None:
    key = "inc-f:gpu-017:reboot"
    store.claim_action(key, "inc-f", "gpu-017", "reboot")
    store.finish_action(key, "failed", detail="TimeoutError: BMC did not answer")
    retried, taken = store.claim_action(key, "inc-f", "gpu-017", "reboot")
    assert taken and retried.status == "intent"
    _, taken_twice = store.claim_action(key, "inc-f", "gpu-017", "reboot")  # the other retrying run
    assert not taken_twice and store.count(ActionRecord) == 1


def test_racing_claims_give_exactly_one_fresh_claim(store: Store) -> None:
    workers = 8
    start = Barrier(workers)

    def claim(n: int) -> tuple[int | None, bool]:
        start.wait()
        row, fresh = store.claim_action("inc-r:gpu-017:reset_gpu", "inc-r", "gpu-017", f"reset_gpu-{n}")
        return row.id, fresh

    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(claim, range(workers)))
    assert sum(fresh for _, fresh in results) == 1
    assert len({row_id for row_id, _ in results}) == 1
    assert store.count(ActionRecord) == 1


def test_node_history_counts_remediations_only(store: Store) -> None:
    store.record_history(
        [
            ev("r-old", -60 * 24 * 10, kind="remediation", attributes={"action": "reboot"}),  # before `since`
            ev("r1", 10, kind="remediation", attributes={"action": "reboot"}),
            ev("r-other-node", 10, node="gpu-002", kind="remediation", attributes={"action": "reboot"}),
        ]
    )
    store.record_events([incident(ev("x1", 0))])  # a fault, not a remediation
    for action, status in [
        ("reset_gpu", "succeeded"),
        ("reboot", "succeeded"),
        ("replace", "succeeded"),
        ("drain", "succeeded"),
        ("resume", "succeeded"),
        ("reboot-failed", "failed"),
    ]:
        name = action.removesuffix("-failed")
        store.claim_action(f"inc-h:{action}", "inc-h", "gpu-017", name)
        store.finish_action(f"inc-h:{action}", status)
    store.claim_action("inc-h:reboot-pending", "inc-h", "gpu-017", "reboot")  # intent only
    store.claim_action("inc-g:reboot", "inc-g", "gpu-002", "reboot")
    store.finish_action("inc-g:reboot", "succeeded")

    history = store.node_history("gpu-017", T0 - timedelta(days=7))
    assert all(h.kind == "remediation" and h.node == "gpu-017" for h in history)
    reported = [h for h in history if h.source != "medic"]
    ours = [h for h in history if h.source == "medic"]
    assert [h.id for h in reported] == ["r1"]
    assert sorted(h.attributes["action"] for h in ours) == ["reboot", "replace", "reset_gpu"]
    assert {h.id for h in ours} == {"action-inc-h:reset_gpu", "action-inc-h:reboot", "action-inc-h:replace"}
    assert all(h.attributes["incident"] == "inc-h" for h in ours)
    assert [h.time for h in history] == sorted(h.time for h in history)
    assert store.node_history("gpu-017", datetime.now(UTC) + timedelta(days=1)) == []


# --- SQLite ----------------------------------------------------------------------------------


def test_sqlite_runs_in_wal_mode(sqlite_store: Store) -> None:
    with sqlite_store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 10000


def test_a_new_sqlite_store_opens_while_another_process_writes_it(tmp_path: Path) -> None:
    # What replicas starting together meet: one is migrating the new file, still in rollback-journal
    # mode, and SQLite answers the others' switch to WAL "database is locked" without waiting.
    path = tmp_path / "medic.db"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("CREATE TABLE another_writer (i INTEGER)")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO another_writer VALUES (1)")
    commit = Timer(0.3, writer.execute, ["COMMIT"])
    commit.start()
    store = Store(f"sqlite:///{path}")
    commit.join()
    writer.close()
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("SELECT i FROM another_writer").scalars().all() == [1]
    store.close()


def _answer_at_once(url: str, approved: bool, start: Any, results: Any) -> None:
    store = Store(url)
    start.wait()
    _, won = store.claim_answer("inc-click", approved=approved, by=f"U{int(approved)}", via="slack")
    results.put((approved, won))
    store.close()


def test_approve_and_reject_clicked_at_once_one_wins(store: Store) -> None:
    store.request_approval("inc-click", "replace")
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(2), context.Queue()
    clicks = [
        context.Process(target=_answer_at_once, args=(store.url, v, start, results)) for v in (True, False)
    ]
    for process in clicks:
        process.start()
    for process in clicks:
        process.join(60)
        assert process.exitcode == 0
    outcomes = dict(results.get(timeout=5) for _ in clicks)
    assert sorted(outcomes.values()) == [False, True]
    (request,) = store.approvals("inc-click")
    winner = next(approved for approved, won in outcomes.items() if won)
    assert (request.approved, request.by) == (winner, f"U{int(winner)}")
    # Taken back (the run could not be told), the next answer may win.
    store.reopen_approval(request.id or 0)
    assert store.claim_answer("inc-click", approved=True, by="U9", via="slack")[1] is True


AROUND_EVENTS = [
    fault_event("xid", id="own", node="n1", switch="leaf-1", job="j1", iteration=7, rank=0),
    fault_event("xid", id="same-node", node="n1", minutes=1),
    fault_event("nan_loss", id="same-job", node="n2", job="j1", minutes=1),
    fault_event("nccl_timeout", id="same-switch", node="n3", switch="leaf-1", minutes=1),
    fault_event("nan_loss", id="same-step", node="n4", iteration=7, rank=3, minutes=1),
    fault_event("xid", id="elsewhere", node="n5", switch="leaf-2", job="j2", iteration=8, minutes=1),
    fault_event("thermal", id="other-kind", node="n1", minutes=1),
    fault_event("xid", id="too-late", node="n1", minutes=90),
]


@pytest.mark.parametrize(
    "around",
    [
        Around(frozenset({EventKind.XID, EventKind.NAN_LOSS, EventKind.NCCL_TIMEOUT}), frozenset({"n1"})),
        Around(
            frozenset({EventKind.XID, EventKind.NAN_LOSS, EventKind.NCCL_TIMEOUT}),
            frozenset({"n1"}),
            jobs=frozenset({"j1"}),
            switches=frozenset({"leaf-1"}),
            iterations=frozenset({7}),
        ),
        Around(frozenset({EventKind.XID}), everywhere=True),
        Around(frozenset({EventKind.XID})),  # nothing to look around: nothing read
    ],
    ids=["node", "every-slice", "everywhere", "nowhere"],
)
def test_a_decision_reads_from_the_store_only_the_events_around_its_incident(
    sqlite_store: Store, around: Around
) -> None:
    """`events_between` with an `Around` gives in SQL what `Around.takes` gives in Python."""
    sqlite_store.record_accepted(AROUND_EVENTS)
    read = sqlite_store.events_between(T0, T0 + timedelta(minutes=60), around)
    expected = [e.id for e in AROUND_EVENTS if e.time <= T0 + timedelta(minutes=60) and around.takes(e)]
    assert sorted(e.id for e in read) == sorted(expected)
    assert "other-kind" not in expected and "too-late" not in expected
