"""Appending to the audit chain, in the same transaction as the writes it seals.

Every store session is an `AuditedSession`. Bulk statements go through `audited`, which digests the
rows they wrote from their `RETURNING`; flushes note which audited rows they wrote, and those are read
back and digested just before the commit. Then the changes are appended to `audit_chain` (`seal`).
One process at a time appends: on PostgreSQL under a transaction-scoped advisory lock, on SQLite
because a transaction that wrote holds the write lock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from typing import Any, Literal

from sqlalchemy import (
    Insert,
    Select,
    String,
    Table,
    Update,
    bindparam,
    cast,
    func,
    insert,
    or_,
    select,
    text,
)
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection
from sqlalchemy.orm import ORMExecuteState, UOWTransaction
from sqlmodel import Session, SQLModel

from medic.errors import PermanentError
from medic.store.chain import AUDITED, GENESIS, ChainKey, Entry, row_digest
from medic.store.tables import AuditChainRecord

CHAIN = SQLModel.metadata.tables[AuditChainRecord.__tablename__]
# Any fixed 64-bit number, other than the schema's: the key of the lock appends are made under.
_APPEND_LOCK_KEY = 0x6D65646963A0  # "medic" + audit
_PENDING = "medic_audit_pending"  # rows flushed: (table, key) -> how, read back at the commit
_DIGESTED = "medic_audit_digested"  # rows bulk statements wrote, already digested: Changes
_KEY = "medic_audit_key"
_TRACKED = "medic_audited"
_CHUNK = 500

_SEALED = "_sealed"  # the label of the newest sealed digest, beside a row read back
# The chain's head and the head of each incident in `ids`, in one round trip: every append reads them.
_HEADS = select(CHAIN.c.seq, CHAIN.c.incident_id, CHAIN.c.hash, CHAIN.c.key_id).where(
    or_(
        CHAIN.c.seq == select(func.max(CHAIN.c.seq)).scalar_subquery(),
        CHAIN.c.seq.in_(
            select(func.max(CHAIN.c.seq))
            .where(CHAIN.c.incident_id.in_(bindparam("ids", expanding=True)))
            .group_by(CHAIN.c.incident_id)
        ),
    )
)

# How a row was written: a new row needs an entry; a changed one only when its digest moved.
Written = Literal["new", "changed"]


class AuditKeyError(PermanentError):
    """Raised when this process's MEDIC_AUDIT_KEY is not the key the chain is keyed with: appending
    would leave entries nobody can check, so nothing is written."""


@dataclass(frozen=True, slots=True)
class Change:
    table: str
    row_key: str
    incident_id: str | None
    digest: str | None  # None: the row is gone


class AuditedSession(Session):
    """A store session: what it writes to an audited table is sealed in the same transaction."""


def open_session(engine: Any, key: ChainKey | None) -> AuditedSession:
    return AuditedSession(engine, expire_on_commit=False, info={_KEY: key})


def audited(session: Session, statement: Insert | Update, params: Any = None) -> list[Any]:
    """Run a bulk INSERT or UPDATE on an audited table; the rows it wrote come back with it (and an
    updated row with the digest its newest entry sealed), so they are digested here, with no read at
    the commit. Returns their keys (the rows it wrote, where a caller wants a count)."""
    table: Table = statement.table  # type: ignore[assignment]  # each of ours names one table
    new = isinstance(statement, Insert)
    returned = [*table.c] if new else [*table.c, _sealed_digest(table.name).label(_SEALED)]
    tracked = statement.returning(*returned).execution_options(**{_TRACKED: True})
    rows = [dict(r) for r in session.execute(tracked, params).mappings()]
    digested: list[Change] = session.info.setdefault(_DIGESTED, [])
    digested += _digested(table.name, rows, _latest(digested, table.name), new=new)
    return [r["id"] for r in rows]


def _note(session: Session, table: str, keys: Iterable[Any], how: Written) -> None:
    pending: dict[tuple[str, Any], Written] = session.info.setdefault(_PENDING, {})
    for key in keys:
        pending.setdefault((table, key), how)


@sa_event.listens_for(AuditedSession, "do_orm_execute")
def _only_tracked_bulk_writes(state: ORMExecuteState) -> None:
    # A bulk statement the session's flush does not see would write rows nobody seals.
    if not (state.is_insert or state.is_update or state.is_delete) or state.execution_options.get(_TRACKED):
        return
    table = getattr(state.bind_mapper.class_, "__tablename__", None) if state.bind_mapper else None
    if table in AUDITED:
        raise TypeError(f"a bulk write to {table} must go through medic.store.ledger.audited")


@sa_event.listens_for(AuditedSession, "after_flush")
def _note_flushed(session: Session, _flush: UOWTransaction) -> None:
    for obj in session.new:
        _note_object(session, obj, "new")
    for obj in session.dirty:
        if session.is_modified(obj, include_collections=False):
            _note_object(session, obj, "changed")
    for obj in session.deleted:
        _note_object(session, obj, "changed")


def _note_object(session: Session, obj: Any, how: Written) -> None:
    table = getattr(obj, "__tablename__", None)
    if table in AUDITED:
        _note(session, table, [obj.id], how)


@sa_event.listens_for(AuditedSession, "before_commit")
def _seal_before_commit(session: Session) -> None:
    session.flush()
    seal(session)


@sa_event.listens_for(AuditedSession, "after_soft_rollback")
def _forget(session: Session, _previous: Any) -> None:
    session.info.pop(_PENDING, None)
    session.info.pop(_DIGESTED, None)


def seal(session: Session) -> None:
    """Append an entry for each audited row this transaction wrote (a row whose digest did not move
    gets none). Called before every commit; a prune calls it before it deletes entries."""
    # Bulk statements' rows first: a flush after one may have written the same row again, and the
    # newest entry must be the row as the commit leaves it.
    changes: list[Change] = session.info.pop(_DIGESTED, [])
    pending: dict[tuple[str, Any], Written] = session.info.pop(_PENDING, {})
    if not (changes or pending):
        return
    connection = session.connection()
    by_table: defaultdict[str, dict[Any, Written]] = defaultdict(dict)
    for (table, key), how in pending.items():
        by_table[table][key] = how
    for table, written in sorted(by_table.items()):
        changes += _changes(connection, table, written, _latest(changes, table))
    append(connection, changes, session.info[_KEY])


def _sealed_digest(table: str) -> Any:
    """For a row of `table`, the digest its newest entry sealed (a correlated scalar subquery)."""
    source = SQLModel.metadata.tables[table]
    return (
        select(CHAIN.c.digest)
        .where(CHAIN.c.table_name == table)
        .where(CHAIN.c.row_key == cast(source.c.id, String))
        .order_by(CHAIN.c.seq.desc())
        .limit(1)
        .scalar_subquery()
    )


@cache
def _reread(table: str) -> Select[Any]:
    """The rows as written, each with the digest its newest entry sealed (one round trip)."""
    source = SQLModel.metadata.tables[table]
    return select(source, _sealed_digest(table).label(_SEALED)).where(
        source.c.id.in_(bindparam("keys", expanding=True))
    )


def _latest(changes: Sequence[Change], table: str) -> dict[str, str | None]:
    """The digest each row of `table` has in the newest of `changes` (this transaction's, so far)."""
    return {c.row_key: c.digest for c in changes if c.table == table}


def _digested(
    table: str, rows: list[dict[str, Any]], earlier: dict[str, str | None], *, new: bool
) -> list[Change]:
    """A change for each row as written (with its sealed digest beside it unless `new`), but one
    whose digest is the one it already has: in this transaction's `earlier` changes, else sealed."""
    spec = AUDITED[table]
    changes = []
    for row in rows:
        sealed = row.pop(_SEALED, None)
        key, digest = str(row["id"]), row_digest(spec, row)
        unchanged = earlier[key] == digest if key in earlier else not new and sealed == digest
        if not unchanged:
            changes.append(Change(table, key, row[spec.incident] if spec.incident else None, digest))
    return changes


def _changes(
    connection: Connection, table: str, written: dict[Any, Written], earlier: dict[str, str | None]
) -> list[Change]:
    """The changes of the rows flushes wrote, read back."""
    keys = sorted(written)
    rows: dict[Any, dict[str, Any]] = {}
    for start in range(0, len(keys), _CHUNK):
        for found in connection.execute(_reread(table), {"keys": keys[start : start + _CHUNK]}).mappings():
            rows[found["id"]] = dict(found)
    # Deleted after it was sealed: an entry without a digest. Written and deleted in one
    # transaction: nothing to seal.
    gone = [Change(table, str(k), None, None) for k in keys if k not in rows and written[k] == "changed"]
    new = [rows[k] for k in keys if k in rows and written[k] == "new"]
    changed = [rows[k] for k in keys if k in rows and written[k] == "changed"]
    return gone + _digested(table, new, earlier, new=True) + _digested(table, changed, earlier, new=False)


def lock(connection: Connection) -> None:
    """Hold the chain until this transaction ends (PostgreSQL; SQLite's writer lock already does)."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _APPEND_LOCK_KEY})


def append(connection: Connection, changes: Sequence[Change], key: ChainKey | None) -> None:
    """Append one entry per change to both chains, under the lock."""
    if not changes:
        return
    lock(connection)
    incidents = {c.incident_id for c in changes if c.incident_id is not None}
    found = list(connection.execute(_HEADS, {"ids": sorted(incidents)}))
    head = max(found, key=lambda r: r.seq, default=None)
    if head is not None and head.key_id is not None and head.key_id != (key.id if key else None):
        raise AuditKeyError(
            f"the audit chain is keyed with key id {head.key_id}; this process's MEDIC_AUDIT_KEY "
            + (f"has id {key.id}" if key else "is not set")
        )
    # The head is also its incident's; any other row found is the head of an incident in `incidents`.
    heads = {r.incident_id: r.hash for r in found if r.incident_id in incidents}
    seq, prev = (head.seq, head.hash) if head is not None else (0, GENESIS)
    at = datetime.now(UTC)
    key_id = key.id if key else None
    rows = []
    for change in changes:
        seq += 1
        entry = Entry(
            seq=seq,
            at=at,
            table=change.table,
            row_key=change.row_key,
            incident_id=change.incident_id,
            digest=change.digest,
            prev_hash=prev,
            incident_prev_hash=heads.get(change.incident_id) if change.incident_id else None,
            key_id=key_id,
        )
        prev = entry.computed_hash(key)
        if change.incident_id is not None:
            heads[change.incident_id] = prev
        rows.append(entry.values() | {"hash": prev})
    connection.execute(insert(CHAIN), rows)
