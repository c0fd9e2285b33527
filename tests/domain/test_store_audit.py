"""The audit chain (docs/store.md#tamper-evidence): every audited write is sealed in its own
transaction, and `verify_chain` names the first broken link after a row or a ledger entry is edited,
deleted or added behind the store's back; on SQLite and PostgreSQL."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
from dataclasses import replace
from datetime import timedelta

import pytest
from audit_support import sql, work_incident
from factories import fault_event, incident
from sqlalchemy import String, cast, text, update
from sqlmodel import SQLModel, col

from medic.intake import Rejection
from medic.store import Store, utcnow
from medic.store.chain import AUDITED, GENESIS, Entry, row_digest
from medic.store.ledger import CHAIN, AuditKeyError, audited
from medic.store.tables import GoodputRecord, IncidentRecord, StepRecord


def audited_rows(store: Store) -> int:
    return sum(sql(store, f'SELECT count(*) FROM "{table}"') for table in AUDITED)


def entry_of(store: Store, table: str, row_key: str) -> int:
    """The seq of a row's newest entry."""
    return sql(
        store,
        "SELECT max(seq) FROM audit_chain WHERE table_name = :t AND row_key = :k",
        t=table,
        k=row_key,
    )


def test_every_write_path_is_sealed_and_the_chain_verifies(store: Store) -> None:
    at = utcnow() - timedelta(hours=1)
    work_incident(store, "inc-a", "gpu-node-1", at, close=True)
    # The rest of the store's writers, each once.
    loose = fault_event(id="loose-1", node="gpu-node-2", at=at)
    store.record_accepted([loose])
    store.attach_events([incident(loose, id="inc-b")])
    store.open_incident(incident(loose, id="inc-b"), owner="bob")
    store.claim_incident("inc-b", "test:r:2", 30)
    store.record_events([incident(fault_event(id="rec-1", node="gpu-node-3", at=at), id="inc-c")])
    store.add_event(fault_event(id="diag-1", node="gpu-node-3", at=at), "inc-c")
    store.record_history([fault_event("remediation", id="hist-1", node="gpu-node-3", at=at)])
    store.claim_action("inc-b:gpu-node-2:drain", "inc-b", "gpu-node-2", "drain")
    store.finish_action("inc-b:gpu-node-2:drain", "failed", "timed out")
    store.claim_action("inc-b:gpu-node-2:drain", "inc-b", "gpu-node-2", "drain")  # taken back
    store.request_approval("inc-b", "replace")
    won = store.claim_answer("inc-b", approved=True, by="carol", via="slack")[0]
    assert won is not None and won.id is not None
    store.reopen_approval(won.id)
    store.open_breaker("storm", "inc-b")
    store.close_breaker("dave")
    # Not audited: the dead letter, its counts, and goodput (derived from audited rows at close).
    store.record_rejections([Rejection("f.jsonl:1", "junk", "not JSON")])
    store.record_goodput(
        [GoodputRecord(incident_id="inc-a", job="j", fault_at=at, detection_s=1, diagnosis_s=2, action_s=3)]
    )

    result = store.verify_chain()

    assert result.ok, [p.describe() for p in result.problems]
    assert result.rows == audited_rows(store)
    assert result.head is not None and result.head.seq == result.entries
    assert sql(store, "SELECT count(DISTINCT table_name || ':' || row_key) FROM audit_chain") == result.rows


def test_a_renewed_lease_adds_no_entry_and_an_unchanged_write_none(store: Store) -> None:
    work_incident(store, "inc-l", "gpu-node-1", utcnow(), close=False)
    before = sql(store, "SELECT count(*) FROM audit_chain")
    assert store.renew_leases("test:r:1", ["inc-l"], 30) == 1
    store.update_incident("inc-l", owner=store.get_incident("inc-l").owner)  # type: ignore[union-attr]
    assert sql(store, "SELECT count(*) FROM audit_chain") == before
    store.update_incident("inc-l", status="remediating")
    assert sql(store, "SELECT count(*) FROM audit_chain") == before + 1


def test_a_row_edited_in_the_database_is_named(store: Store) -> None:
    work_incident(store, "inc-e", "gpu-node-1", utcnow(), close=True)
    decision = sql(store, "SELECT id FROM decisions WHERE incident_id = 'inc-e'")
    sealed_at = entry_of(store, "decisions", str(decision))
    assert store.verify_chain().ok

    sql(store, "UPDATE decisions SET rule = 'reboot-anyway' WHERE id = :id", id=decision)
    result = store.verify_chain()

    assert not result.ok
    first = result.problems[0]
    assert (first.seq, first.table, first.row_key, first.incident_id) == (
        sealed_at,
        "decisions",
        str(decision),
        "inc-e",
    )
    assert "content differs" in first.what
    assert len(result.problems) == 1


def test_a_row_deleted_in_the_database_is_named(store: Store) -> None:
    work_incident(store, "inc-d", "gpu-node-1", utcnow(), close=True)
    step = sql(store, "SELECT id FROM steps WHERE incident_id = 'inc-d'")
    sql(store, "DELETE FROM steps WHERE id = :id", id=step)

    first = store.verify_chain().problems[0]

    assert (first.seq, first.table, first.row_key) == (
        entry_of(store, "steps", str(step)),
        "steps",
        str(step),
    )
    assert "gone" in first.what


def test_a_row_added_behind_the_store_is_named(store: Store) -> None:
    work_incident(store, "inc-n", "gpu-node-1", utcnow(), close=True)
    sql(
        store,
        "INSERT INTO steps (incident_id, stage, started_at, finished_at, status, summary) "
        "VALUES ('inc-n', 'verify', :t, :t, 'ok', 'node verified')",
        t=utcnow(),
    )

    problems = store.verify_chain().problems

    assert [(p.seq, p.table, p.incident_id) for p in problems] == [(None, "steps", "inc-n")]
    assert "no ledger entry" in problems[0].what


def test_an_edited_ledger_entry_is_named(store: Store) -> None:
    work_incident(store, "inc-x", "gpu-node-1", utcnow(), close=True)
    action = sql(store, "SELECT id FROM actions WHERE incident_id = 'inc-x'")
    seq = entry_of(store, "actions", str(action))
    sql(store, "UPDATE audit_chain SET digest = :d WHERE seq = :s", d="0" * 64, s=seq)

    result = store.verify_chain()

    assert result.problems[0].seq == seq
    assert result.problems[0].table == "actions"
    assert "hash does not match" in result.problems[0].what


def test_a_deleted_ledger_entry_is_named(store: Store) -> None:
    work_incident(store, "inc-y", "gpu-node-1", utcnow(), close=True)
    sql(store, "DELETE FROM audit_chain WHERE seq = 3")

    first = store.verify_chain().problems[0]

    assert first.seq == 3
    assert "missing" in first.what


def rewrite_chain(store: Store, from_seq: int) -> None:
    """Seal the rows as they are now, recomputing every entry from `from_seq` on without a key: what
    someone who can edit the database, but does not hold MEDIC_AUDIT_KEY, can do after an edit."""
    with store.engine.begin() as connection:
        prev, heads = GENESIS, {}
        for row in connection.execute(CHAIN.select().order_by(CHAIN.c.seq)).mappings().all():
            entry = Entry.of(row)
            if entry.seq >= from_seq:
                table = SQLModel.metadata.tables[entry.table]
                now = connection.execute(table.select().where(cast(table.c.id, String) == entry.row_key))
                entry = replace(
                    entry,
                    digest=row_digest(AUDITED[entry.table], now.mappings().one()),
                    prev_hash=prev,
                    incident_prev_hash=heads.get(entry.incident_id) if entry.incident_id else None,
                    key_id=None,
                )
                entry = replace(entry, hash=entry.computed_hash(None))
                connection.execute(CHAIN.update().where(CHAIN.c.seq == entry.seq).values(entry.values()))
            prev = entry.hash
            if entry.incident_id:
                heads[entry.incident_id] = entry.hash


def edit_a_decision_and_rewrite_the_chain(store: Store, incident_id: str) -> int:
    decision = sql(store, "SELECT id FROM decisions WHERE incident_id = :i", i=incident_id)
    seq = entry_of(store, "decisions", str(decision))
    sql(store, "UPDATE decisions SET rule = 'reboot-anyway' WHERE id = :id", id=decision)
    rewrite_chain(store, seq)
    return seq


def test_hashing_alone_does_not_stop_someone_who_rewrites_the_chain(store: Store) -> None:
    work_incident(store, "inc-h", "gpu-node-1", utcnow(), close=True)
    edit_a_decision_and_rewrite_the_chain(store, "inc-h")
    assert store.verify_chain().ok  # the limit docs/store.md states: this is what the key is for


def test_with_the_key_a_rewritten_chain_is_named(store: Store) -> None:
    keyed = Store(store.url, audit_key="correct horse battery staple")
    work_incident(keyed, "inc-k", "gpu-node-1", utcnow(), close=True)
    assert keyed.verify_chain().ok

    seq = edit_a_decision_and_rewrite_the_chain(store, "inc-k")
    result = keyed.verify_chain()

    assert (result.problems[0].seq, result.problems[0].table) == (seq, "decisions")
    assert "unkeyed entry after keyed ones" in result.problems[0].what
    keyed.close()


def test_without_the_key_a_keyed_chain_is_checked_but_its_hashes_are_not(store: Store) -> None:
    keyed = Store(store.url, audit_key="correct horse battery staple")
    work_incident(keyed, "inc-u", "gpu-node-1", utcnow(), close=True)
    result = store.verify_chain()
    assert result.ok
    assert result.unchecked == result.entries > 0
    keyed.close()


def test_a_writer_without_the_chain_s_key_writes_nothing(store: Store) -> None:
    keyed = Store(store.url, audit_key="key-a")
    work_incident(keyed, "inc-w", "gpu-node-1", utcnow(), close=False)
    before = sql(store, "SELECT count(*) FROM steps")
    for writer in (Store(store.url, audit_key="key-b"), store):
        with pytest.raises(AuditKeyError, match="keyed with key id"):
            writer.add_step("inc-w", "verify", utcnow(), "ok", "unsealed")
    assert sql(store, "SELECT count(*) FROM steps") == before
    keyed.close()


def test_verify_since_walks_only_the_newer_entries(store: Store) -> None:
    work_incident(store, "inc-old", "gpu-node-1", utcnow(), close=True)
    sql(store, "UPDATE audit_chain SET at = :t", t=utcnow() - timedelta(days=3))
    old_step = sql(store, "SELECT id FROM steps WHERE incident_id = 'inc-old'")
    sql(store, "UPDATE steps SET summary = 'edited' WHERE id = :id", id=old_step)
    work_incident(store, "inc-new", "gpu-node-2", utcnow(), close=True)

    since = store.verify_chain(since=utcnow() - timedelta(days=1))

    assert since.ok and since.entries == sql(
        store, "SELECT count(*) FROM audit_chain WHERE incident_id = 'inc-new' OR row_key LIKE 'inc-new%'"
    )
    assert not store.verify_chain().ok


def test_a_bulk_write_that_bypasses_the_ledger_is_refused(store: Store) -> None:
    with store.session() as s, pytest.raises(TypeError, match=r"ledger\.audited"):
        s.exec(update(StepRecord).values(summary="unsealed"))


EACH = 8


def _write_at_once(url: str, name: str, start: multiprocessing.synchronize.Barrier) -> None:
    store = Store(url)
    start.wait()
    for n in range(EACH):
        work_incident(store, f"inc-{name}-{n}", f"node-{name}-{n}", utcnow(), close=True)
    store.close()


def test_two_processes_writing_at_once_keep_one_linear_chain(store: Store) -> None:
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    writers = [context.Process(target=_write_at_once, args=(store.url, name, start)) for name in "ab"]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
        assert writer.exitcode == 0

    result = store.verify_chain()

    assert result.ok, [p.describe() for p in result.problems[:5]]
    assert result.rows == audited_rows(store)
    assert sql(store, "SELECT count(*) FROM incidents") == 2 * EACH
    assert sql(store, "SELECT max(seq) - min(seq) + 1 - count(*) FROM audit_chain") == 0


def test_verify_reads_one_snapshot_while_writers_go_on(store: Store) -> None:
    work_incident(store, "inc-s", "gpu-node-1", utcnow(), close=False)
    with store.snapshot() as connection:
        before = connection.execute(text("SELECT count(*) FROM steps")).scalar()
        store.add_step("inc-s", "diagnose", utcnow(), "ok", "written meanwhile")
        assert connection.execute(text("SELECT count(*) FROM steps")).scalar() == before


def test_a_row_written_several_times_in_one_transaction_is_sealed_as_the_commit_leaves_it(
    store: Store,
) -> None:
    work_incident(store, "inc-t", "gpu-node-1", utcnow(), close=False)
    with store.session() as s:
        by_id = update(IncidentRecord).where(col(IncidentRecord.id) == "inc-t")
        audited(s, by_id.values(owner="someone else"))
        audited(s, by_id.values(owner=None))  # back to what is sealed
        s.commit()
    assert store.verify_chain().ok
    with store.session() as s:
        audited(s, update(IncidentRecord).where(col(IncidentRecord.id) == "inc-t").values(owner="bulk"))
        row = s.get(IncidentRecord, "inc-t")
        assert row is not None
        row.owner = "flushed after"
        s.add(row)
        s.commit()
    assert store.verify_chain().ok
    assert store.get_incident("inc-t").owner == "flushed after"  # type: ignore[union-attr]
