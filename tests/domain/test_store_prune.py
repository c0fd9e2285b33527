"""Retention (docs/store.md#retention): a prune archives what it removes, signed, before removing it;
the chain still verifies afterwards, the archive verifies on its own, a tampered archive does not,
and an incident still active is never pruned; on SQLite and PostgreSQL."""

from __future__ import annotations

import gzip
import hashlib
import json
from datetime import timedelta
from pathlib import Path

import pytest
from audit_support import sql, work_incident

from medic.store import Store, utcnow
from medic.store.archive import read_archive, verify_archive
from medic.store.chain import ChainKey
from medic.store.prune import PruneRefused

DAYS_AGO = utcnow() - timedelta(days=100)
CUTOFF = utcnow() - timedelta(days=30)


def rows_of(store: Store, incident_id: str) -> int:
    tables = ("events", "steps", "diagnostics", "decisions", "actions", "approvals", "goodput")
    of = sum(sql(store, f"SELECT count(*) FROM {t} WHERE incident_id = :i", i=incident_id) for t in tables)
    return of + sql(store, "SELECT count(*) FROM incidents WHERE id = :i", i=incident_id)


def test_prune_archives_removes_and_the_chain_still_verifies(store: Store, tmp_path: Path) -> None:
    work_incident(store, "inc-old-1", "gpu-node-1", DAYS_AGO, close=True)
    work_incident(store, "inc-active", "gpu-node-2", DAYS_AGO, close=False)
    work_incident(store, "inc-old-2", "gpu-node-3", DAYS_AGO, close=True)
    work_incident(store, "inc-recent", "gpu-node-4", utcnow(), close=True)
    store.add_step("inc-active", "diagnose", DAYS_AGO, "ok", "written after the others")  # interleaved
    removed = rows_of(store, "inc-old-1") + rows_of(store, "inc-old-2")
    archive = tmp_path / "audit-2025.jsonl.gz"

    pruned = store.prune(CUTOFF, archive)

    assert (pruned.incidents, pruned.rows, pruned.kept_active) == (2, removed, 1)
    assert rows_of(store, "inc-old-1") == rows_of(store, "inc-old-2") == 0
    assert rows_of(store, "inc-active") > 0 and rows_of(store, "inc-recent") > 0
    assert pruned.after is not None and pruned.after.ok, [p.describe() for p in pruned.after.problems]
    assert pruned.after.pruned == pruned.entries
    written = read_archive(archive)
    assert written.sha256 == pruned.archive_sha256
    assert verify_archive(written, store.audit_key).ok
    assert {r.values.get("incident_id", r.values["id"]) for r in written.rows} == {"inc-old-1", "inc-old-2"}
    assert len(written.rows) == removed and len(written.entries) == pruned.entries
    record = store.prune_record(written.sha256)
    assert record is not None and record.runs == [r.as_list() for r in written.runs]
    store.add_step("inc-active", "verify", utcnow(), "ok", "the chain goes on")
    assert store.verify_chain().ok


def test_a_prune_whose_last_entry_is_the_head_and_a_second_prune_after_it(
    store: Store, tmp_path: Path
) -> None:
    work_incident(store, "inc-a", "gpu-node-1", DAYS_AGO, close=True)
    work_incident(store, "inc-b", "gpu-node-2", DAYS_AGO, close=False)
    store.update_incident("inc-a", outcome="rebooted")  # the newest entry is a pruned one
    assert store.prune(CUTOFF, tmp_path / "first.gz").incidents == 1
    store.update_incident("inc-b", status="closed", closed_at=DAYS_AGO)

    second = store.prune(CUTOFF, tmp_path / "second.gz")

    assert second.incidents == 1 and second.after is not None and second.after.ok
    assert sql(store, "SELECT count(*) FROM incidents") == 0
    assert second.after.entries == 2  # the two prune records: all that is left of the chain
    assert all(verify_archive(read_archive(tmp_path / n), None).ok for n in ("first.gz", "second.gz"))


def test_an_active_incident_is_never_pruned(store: Store, tmp_path: Path) -> None:
    work_incident(store, "inc-still", "gpu-node-1", DAYS_AGO, close=False)
    before = rows_of(store, "inc-still")

    pruned = store.prune(CUTOFF, tmp_path / "none.gz")

    assert (pruned.incidents, pruned.kept_active, pruned.archive_sha256) == (0, 1, None)
    assert rows_of(store, "inc-still") == before
    assert not (tmp_path / "none.gz").exists()


def test_a_broken_chain_is_not_pruned(store: Store, tmp_path: Path) -> None:
    work_incident(store, "inc-t", "gpu-node-1", DAYS_AGO, close=True)
    sql(store, "UPDATE steps SET summary = 'edited' WHERE incident_id = 'inc-t'")
    with pytest.raises(PruneRefused, match="does not verify"):
        store.prune(CUTOFF, tmp_path / "a.gz")
    assert rows_of(store, "inc-t") > 0 and not (tmp_path / "a.gz").exists()


def test_an_existing_archive_is_never_overwritten(store: Store, tmp_path: Path) -> None:
    work_incident(store, "inc-f", "gpu-node-1", DAYS_AGO, close=True)
    (tmp_path / "a.gz").write_bytes(b"kept")
    with pytest.raises(FileExistsError):
        store.prune(CUTOFF, tmp_path / "a.gz")
    assert (tmp_path / "a.gz").read_bytes() == b"kept" and rows_of(store, "inc-f") > 0


def rewrite(path: Path, edit: str, *, resign: bool) -> None:
    """Change a row's value inside an archive; with `resign`, write its sha256 again to match."""
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    lines = [line.replace('"rule":"xid-fallen-off-bus"', f'"rule":"{edit}"') for line in lines]
    content = "".join(line + "\n" for line in lines[:-1]).encode()
    signature = json.loads(lines[-1])
    if resign:
        signature["signature"]["sha256"] = hashlib.sha256(content).hexdigest()
    path.write_bytes(gzip.compress(content + json.dumps(signature).encode() + b"\n"))


@pytest.mark.parametrize(
    ("resign", "key", "caught"),
    [
        (False, None, "does not match its sha256"),
        (True, None, "content differs from what seq"),  # the rows no longer match their entries
        (True, "k", "HMAC signature does not match"),
    ],
)
def test_a_tampered_archive_fails(
    sqlite_store: Store, tmp_path: Path, resign: bool, key: str | None, caught: str
) -> None:
    store = Store(sqlite_store.url, audit_key=key)
    work_incident(store, "inc-z", "gpu-node-1", DAYS_AGO, close=True)
    archive = tmp_path / "a.gz"
    store.prune(CUTOFF, archive)
    assert verify_archive(read_archive(archive), ChainKey.of(key)).ok

    rewrite(archive, "reboot-anyway", resign=resign)
    check = verify_archive(read_archive(archive), ChainKey.of(key))

    assert not check.ok
    assert any(caught in p.what for p in check.problems), [p.describe() for p in check.problems]
