"""The schema of the last release before alembic (revision 0001), frozen: medic/store/tables.py moves
on, this does not.

Stores of that release and the ones before it were made by `create_all`, which never changes a table
it finds, plus an ALTER for each nullable column and index added since: `bring_up` does the same, so
that every such store, whatever release wrote it, leaves the baseline revision with this schema.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    inspect,
    text,
)
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.schema import CreateIndex

from medic.store.types import UTCDateTime

log = logging.getLogger(__name__)

METADATA = MetaData()
_ACTIVE_SQL = "status IN ('open', 'remediating', 'waiting for approval')"


def _time(name: str, *, nullable: bool = False, index: bool = False) -> Column[datetime]:
    return Column(name, UTCDateTime(), nullable=nullable, index=index)


def _id() -> Column[int]:
    return Column("id", Integer, primary_key=True)


def _str(name: str, *, nullable: bool = False, index: bool = False) -> Column[str]:
    return Column(name, String, nullable=nullable, index=index)


Table(
    "events",
    METADATA,
    Column("id", String(200), primary_key=True),
    _time("time", index=True),
    _time("received_at"),
    _str("source"),
    _str("kind", index=True),
    _str("node", index=True),
    Column("gpu", BigInteger),
    _str("job", nullable=True, index=True),
    Column("rank", BigInteger),
    Column("iteration", BigInteger),
    _str("switch", nullable=True),
    Column("attributes", JSON),
    _str("incident_id", nullable=True, index=True),
)
Table(
    "rejected_events",
    METADATA,
    _id(),
    _time("received_at", index=True),
    _str("origin"),
    Column("raw", Text, nullable=False),
    Column("reason", Text, nullable=False),
)
Table(
    "rejection_counts",
    METADATA,
    _id(),
    _str("source"),
    _str("reason_class"),
    Column("rejected", BigInteger, nullable=False),
    Column("kept", BigInteger, nullable=False),
    _time("first_seen"),
    _time("last_seen", index=True),
    UniqueConstraint("source", "reason_class"),
)
Table(
    "incidents",
    METADATA,
    Column("id", String, primary_key=True),
    _str("node", index=True),
    _str("scope"),
    _str("switch", nullable=True),
    _time("opened_at", index=True),
    _time("last_event_at"),
    _time("closed_at", nullable=True),
    _str("status", index=True),
    Column("jobs", JSON),
    _str("owner", nullable=True, index=True),
    _str("classification", nullable=True),
    _str("action", nullable=True),
    _str("rule", nullable=True),
    Column("outcome", Text),
    _str("flow_run_id", nullable=True),
    _str("flow_run_name", nullable=True),
    _str("runner", nullable=True),
    _time("lease_until", nullable=True),
    Index(
        "uq_incidents_one_active",
        "node",
        "scope",
        unique=True,
        sqlite_where=text(_ACTIVE_SQL),
        postgresql_where=text(_ACTIVE_SQL),
    ),
)
Table(
    "steps",
    METADATA,
    _id(),
    _str("incident_id", index=True),
    _str("stage"),
    _time("started_at"),
    _time("finished_at"),
    _str("status"),
    Column("summary", Text, nullable=False),
    Column("detail", JSON),
)
Table(
    "diagnostics",
    METADATA,
    _id(),
    _str("incident_id", index=True),
    _str("node", index=True),
    Column("level", Integer, nullable=False),
    _str("result"),
    Column("error_ids", JSON),
    _time("started_at"),
    _time("finished_at"),
    Column("detail", Text, nullable=False),
)
Table(
    "decisions",
    METADATA,
    _id(),
    _str("incident_id", index=True),
    _time("decided_at"),
    _str("policy_path"),
    _str("policy_sha256"),
    _str("rule"),
    _str("classification"),
    _str("action"),
    Column("diagnose_level", Integer),
    Column("reason", Text, nullable=False),
    Column("matched", JSON),
    Column("recommend", JSON),
    _str("guardrail", nullable=True),
    _str("blocked_action", nullable=True),
    Column("facts", JSON),
)
Table(
    "actions",
    METADATA,
    _id(),
    _str("key"),
    _str("incident_id", index=True),
    _str("node", index=True),
    _str("action"),
    _str("status"),
    Column("attempts", Integer, nullable=False),
    _time("intent_at"),
    _time("finished_at", nullable=True),
    Column("detail", Text, nullable=False),
    UniqueConstraint("key"),
)
Table(
    "goodput",
    METADATA,
    _id(),
    _str("incident_id", index=True),
    _str("job", index=True),
    _time("fault_at", index=True),
    Column("detection_s", Float, nullable=False),
    Column("diagnosis_s", Float, nullable=False),
    Column("action_s", Float, nullable=False),
    Column("recovery_s", Float),
    Column("lost_work_s", Float),
    UniqueConstraint("incident_id", "job"),
)
Table(
    "approvals",
    METADATA,
    _id(),
    _str("incident_id", index=True),
    _str("action"),
    _time("requested_at"),
    _time("answered_at", nullable=True),
    Column("approved", Boolean),
    _str("by", nullable=True),
    _str("via", nullable=True),
    Column("comment", Text, nullable=False),
)
Table(
    "breaker",
    METADATA,
    _id(),
    _time("opened_at"),
    Column("reason", Text, nullable=False),
    _str("incident_id", nullable=True),
    _time("closed_at", nullable=True),
    _str("closed_by", nullable=True),
    Index(
        "uq_breaker_one_open",
        text("(closed_at IS NULL)"),
        unique=True,
        sqlite_where=text("closed_at IS NULL"),
        postgresql_where=text("closed_at IS NULL"),
    ),
)


def bring_up(connection: Connection) -> None:
    """Create the tables a store lacks, and the nullable columns and indexes its tables lack (in a
    migration: `op` adds the columns)."""
    from alembic import op  # not at the top: a store already migrated opens without alembic

    METADATA.create_all(connection)
    found = inspect(connection)
    for table in METADATA.sorted_tables:
        have = {c["name"] for c in found.get_columns(table.name)}
        for column in table.columns:
            if column.name not in have and column.nullable:
                op.add_column(table.name, Column(column.name, column.type))
        for index in table.indexes:
            _create_index(connection, index)


# The catalog's index names: one cheap query at every start (the inspector reflects each index, and
# skips expression indexes with a warning).
_INDEX_NAMES = {
    "postgresql": "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()",
    "sqlite": "SELECT name FROM sqlite_master WHERE type = 'index'",
}


def retry_unique_indexes(connection: Connection) -> None:
    """Create the unique indexes a store's rows kept the baseline from creating, once they allow it:
    a store of an earlier release may hold two active incidents for one node (runs that died before
    incidents had leases), and runs without the index, saying so at every start, until one is closed."""
    query = _INDEX_NAMES.get(connection.dialect.name)
    if query is None:
        return
    have = set(connection.execute(text(query)).scalars())
    for table in METADATA.sorted_tables:
        for index in table.indexes:
            if index.unique and index.name not in have:
                _create_index(connection, index)
    connection.commit()


def _create_index(connection: Connection, index: Index) -> None:
    savepoint = connection.begin_nested()  # on PostgreSQL a failed statement spoils its transaction
    try:
        connection.execute(CreateIndex(index, if_not_exists=True))
    except IntegrityError as error:
        savepoint.rollback()
        log.warning("store index %s not created: %s", index.name, error.orig)
    else:
        savepoint.commit()
