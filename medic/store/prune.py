"""`medic audit prune`: incidents handled before a date leave the store, archived first.

What leaves: each incident no longer active (closed, escalated, failed) that ended before the date,
with every row tied to it (events, steps, diagnostics, decisions, actions, approvals, goodput, outbox) and
their ledger entries. In order: the chain is verified; the rows and entries are written to a signed
archive, which is read back and verified; then one transaction seals a prune record (the archive's
sha256, the chain's head, the runs of entries removed) and deletes exactly what was archived. The
chain still verifies afterwards: it links across each run through the record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.engine import Connection
from sqlmodel import SQLModel, col

from medic.errors import PermanentError
from medic.statuses import ACTIVE_INCIDENT_STATUSES
from medic.store import ledger
from medic.store.archive import ArchivedRow, read_archive, verify_archive, write_archive
from medic.store.chain import AUDITED, Entry, Run, jsonable, row_digest, runs_of
from medic.store.engine import utcnow
from medic.store.ledger import CHAIN
from medic.store.tables import AuditPruneRecord, IncidentRecord
from medic.store.verify import PRUNES, Verification, VerifyMixin

# The tables whose rows belong to an incident, by their `incident_id`; `incidents` itself by `id`.
_OF_INCIDENT = ("events", "steps", "diagnostics", "decisions", "actions", "approvals", "goodput", "outbox")
_CHUNK = 500


class PruneRefused(PermanentError):
    """Raised when a prune would remove something it cannot account for: the chain does not verify,
    the archive does not read back, or the store changed under the prune."""


@dataclass(frozen=True, slots=True)
class Pruned:
    incidents: int
    rows: int
    entries: int
    kept_active: int  # incidents still active that began before the date: never pruned
    archive_sha256: str | None  # None: nothing to prune, no archive written
    after: Verification | None  # the chain after the prune


@dataclass(frozen=True, slots=True)
class _Plan:
    incidents: list[str]
    rows: dict[str, list[dict[str, Any]]]  # table -> rows, as jsonable values
    entries: list[Entry]
    runs: list[Run]  # of the entries: consecutive seqs
    head: Entry

    @property
    def row_count(self) -> int:
        return sum(len(rows) for rows in self.rows.values())


class PruneMixin(VerifyMixin):
    def prune(self, before: datetime, archive: Path) -> Pruned:
        """Archive to `archive` (a new file) then remove the incidents no longer active that ended
        before `before`, with their rows and ledger entries."""
        checked = self.verify_chain()
        if not checked.ok:
            raise PruneRefused(f"the audit chain does not verify: {checked.problems[0].describe()}")
        with self.snapshot() as connection:
            kept = _kept_active(connection, before)
            plan = _plan(connection, before)
        if plan is None:
            return Pruned(0, 0, 0, kept, None, None)
        sha256 = self._archive(plan, before, archive)
        self._remove(plan, before, archive, sha256)
        return Pruned(
            len(plan.incidents), plan.row_count, len(plan.entries), kept, sha256, self.verify_chain()
        )

    def prune_record(self, archive_sha256: str) -> AuditPruneRecord | None:
        """The prune that wrote the archive with this sha256, if it was this store's."""
        query = select(PRUNES).where(PRUNES.c.archive_sha256 == archive_sha256)
        with self.engine.connect() as connection:
            row = connection.execute(query).mappings().first()
        return None if row is None else AuditPruneRecord.model_validate(dict(row))

    def _archive(self, plan: _Plan, before: datetime, path: Path) -> str:
        header = {
            "created_at": utcnow().isoformat(),
            "before": before.isoformat(),
            "incidents": plan.incidents,
            "head_seq": plan.head.seq,
            "head_hash": plan.head.hash,
        }
        rows = [
            ArchivedRow(table, values) for table, table_rows in plan.rows.items() for values in table_rows
        ]
        sha256 = write_archive(path, header, rows, plan.entries, plan.runs, self.audit_key)
        written = read_archive(path)
        check = verify_archive(written, self.audit_key)
        if not check.ok or written.sha256 != sha256 or len(written.rows) != len(rows):
            raise PruneRefused(f"{path} did not read back as written; nothing was removed")
        return sha256

    def _remove(self, plan: _Plan, before: datetime, archive: Path, sha256: str) -> None:
        keys = _row_keys(plan)
        with self.session() as s:
            s.add(
                AuditPruneRecord(
                    pruned_at=utcnow(),
                    before=before,
                    archive=archive.name,
                    archive_sha256=sha256,
                    incidents=len(plan.incidents),
                    rows=plan.row_count,
                    entries=len(plan.entries),
                    head_seq=plan.head.seq,
                    head_hash=plan.head.hash,
                    runs=[r.as_list() for r in plan.runs],
                )
            )
            s.flush()
            connection = s.connection()
            # Deleted without entries of their own: the record's runs account for them. Before the
            # chain's lock: holding it, we could wait for a row whose writer waits for the lock.
            for table, ids in keys.items():
                source = SQLModel.metadata.tables[table]
                for chunk in _chunks(ids):
                    connection.execute(delete(source).where(source.c.id.in_(chunk)))
            ledger.lock(connection)  # nothing appends from here to the commit
            _refuse_changes_since(connection, plan, keys)
            ledger.seal(s)  # the record's entry follows the head, which may be among those removed next
            for chunk in _chunks([e.seq for e in plan.entries]):
                connection.execute(delete(CHAIN).where(CHAIN.c.seq.in_(chunk)))
            s.commit()


def _kept_active(connection: Connection, before: datetime) -> int:
    query = (
        select(func.count())
        .select_from(IncidentRecord)
        .where(col(IncidentRecord.status).in_(sorted(ACTIVE_INCIDENT_STATUSES)))
        .where(col(IncidentRecord.opened_at) < before)
    )
    return int(connection.execute(query).scalar_one())


def _plan(connection: Connection, before: datetime) -> _Plan | None:
    head_row = connection.execute(select(CHAIN).order_by(CHAIN.c.seq.desc()).limit(1)).mappings().first()
    incidents_table = SQLModel.metadata.tables["incidents"]
    ended = func.coalesce(incidents_table.c.closed_at, incidents_table.c.last_event_at)
    query = (
        select(incidents_table)
        .where(incidents_table.c.status.not_in(sorted(ACTIVE_INCIDENT_STATUSES)))
        .where(ended < before)
        .order_by(incidents_table.c.id)
    )
    incidents = [dict(r) for r in connection.execute(query).mappings()]
    if not incidents or head_row is None:
        return None
    head = Entry.of(head_row)
    ids = [r["id"] for r in incidents]
    rows: dict[str, list[dict[str, Any]]] = {"incidents": incidents}
    for table in _OF_INCIDENT:
        source = SQLModel.metadata.tables[table]
        rows[table] = [
            dict(r)
            for chunk in _chunks(ids)
            for r in connection.execute(
                select(source).where(source.c.incident_id.in_(chunk)).order_by(source.c.id)
            ).mappings()
        ]
    entries = _entries_of(connection, rows, head.seq)
    _refuse_unsealed(rows, entries)
    jsonable_rows = {table: [jsonable(r) for r in table_rows] for table, table_rows in rows.items()}
    return _Plan(ids, jsonable_rows, entries, runs_of(entries), head)


def _entries_of(connection: Connection, rows: dict[str, list[dict[str, Any]]], up_to: int) -> list[Entry]:
    entries: list[Entry] = []
    for table, table_rows in rows.items():
        if table not in AUDITED:
            continue
        for chunk in _chunks([str(r["id"]) for r in table_rows]):
            query = (
                select(CHAIN)
                .where(CHAIN.c.table_name == table)
                .where(CHAIN.c.row_key.in_(chunk))
                .where(CHAIN.c.seq <= up_to)
            )
            entries += [Entry.of(r) for r in connection.execute(query).mappings()]
    return sorted(entries, key=lambda e: e.seq)


def _refuse_unsealed(rows: dict[str, list[dict[str, Any]]], entries: list[Entry]) -> None:
    """Every audited row must be as its newest entry sealed it: else it changed after the head was
    read, and the archive would not verify."""
    latest = {(e.table, e.row_key): e.digest for e in entries}
    for table, table_rows in rows.items():
        spec = AUDITED.get(table)
        if spec is None:
            continue
        for row in table_rows:
            if latest.get((table, str(row["id"]))) != row_digest(spec, row):
                raise PruneRefused(f"{table} {row['id']} changed while the prune read it: run it again")


def _row_keys(plan: _Plan) -> dict[str, list[Any]]:
    return {table: [r["id"] for r in rows] for table, rows in plan.rows.items() if rows}


def _refuse_changes_since(connection: Connection, plan: _Plan, keys: dict[str, list[Any]]) -> None:
    """An entry after the archive's head about a pruned incident or row: it is not in the archive."""
    pruned_rows = {(table, str(k)) for table, ids in keys.items() for k in ids}
    incidents = set(plan.incidents)
    later = connection.execute(select(CHAIN).where(CHAIN.c.seq > plan.head.seq)).mappings()
    for row in later:
        if row["incident_id"] in incidents or (row["table_name"], row["row_key"]) in pruned_rows:
            raise PruneRefused(
                f"{row['table_name']} {row['row_key']} was written after the archive was: nothing was removed; "
                "run the prune again with a new archive"
            )


def _chunks(values: Sequence[Any]) -> list[Sequence[Any]]:
    return [values[i : i + _CHUNK] for i in range(0, len(values), _CHUNK)]
