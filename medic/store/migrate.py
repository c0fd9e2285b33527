"""The store's schema is alembic's (the revisions in medic/store/migrations/versions/): every store is
brought to the newest revision the first time a process of this release opens it.

A store written before the schema was under alembic has tables but no version: the baseline
revision brings whatever it has up to the baseline (tables, nullable columns and indexes added
since), and the revisions after it run as on any store. One process at a time migrates: the others
wait, then find the store at the head.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, inspect, text
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from medic.errors import PermanentError
from medic.store import sqlite
from medic.store.chain import ChainKey
from medic.store.migrations import baseline

SCRIPTS = Path(__file__).parent / "migrations"
# Not alembic's default name: a store may share its database with another alembic user (Prefect's).
VERSION_TABLE = "medic_alembic_version"
# The newest revision in migrations/versions/ (tests/domain/test_store_migrations.py holds the two equal).
# Named here, a store already at it opens without loading alembic: a quarter of a second of every
# `medic` command's start.
HEAD = "0005"
# The store schema each release writes, as CHANGELOG.md says it: a release that adds a migration names
# its new head here (tests/entrypoints/test_packaging.py fails until this release's entry is HEAD). An operator
# upgrading reads here which releases can share a store.
SCHEMA_OF_RELEASE = {"0.1.0": "0002", "0.2.0": "0002", "0.3.0": "0005"}
# Any fixed 64-bit number: the key of the advisory lock GPU Medic's processes migrate under.
_SCHEMA_LOCK_KEY = 0x6D65646963  # "medic"
# A migration of a large store may take minutes; the processes that start meanwhile wait for it.
_SQLITE_WAIT_MS = 600_000


class SchemaError(PermanentError):
    """Raised when the store's schema is a revision this release does not know: a later release
    migrated it, and this one would write rows that schema does not expect."""


def _at_head(connection: Connection) -> bool:
    if not inspect(connection).has_table(VERSION_TABLE):
        return False
    return connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all() == [HEAD]


def upgrade(engine: Engine, key: ChainKey | None) -> None:
    """Bring the store to the newest revision. Rows present when the audit chain is added are
    sealed with `key`."""
    with engine.connect() as connection:
        if _at_head(connection):
            baseline.retry_unique_indexes(connection)
            return
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    with _exclusive(engine) as connection:
        found = MigrationContext.configure(
            connection, opts={"version_table": VERSION_TABLE}
        ).get_current_revision()
        known = {s.revision for s in ScriptDirectory(str(SCRIPTS)).walk_revisions()}
        if found is not None and found not in known:
            raise SchemaError(
                f"the store's schema is revision {found}, newer than this release knows ({HEAD}): "
                "run a release at least as new"
            )
        config = Config()
        config.set_main_option("script_location", str(SCRIPTS))
        config.attributes.update(connection=connection, audit_key=key, version_table=VERSION_TABLE)
        command.upgrade(config, "head")


@contextmanager
def _exclusive(engine: Engine) -> Iterator[Connection]:
    """A transaction no other process migrates beside. Two replicas starting together on an empty
    PostgreSQL database would both create a table, and one fail on the catalog."""
    if engine.dialect.name == "postgresql":
        with engine.begin() as connection:
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
            yield connection
        return
    if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
        with engine.begin() as connection:
            yield connection
        return
    # pysqlite begins a transaction only before DML, so DDL would commit on its own: this engine
    # begins one itself, IMMEDIATE, taking SQLite's writer lock for the whole migration.
    exclusive = create_engine(engine.url, poolclass=NullPool)

    @sa_event.listens_for(exclusive, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        sqlite.prepare(dbapi_connection, busy_timeout_ms=_SQLITE_WAIT_MS)

    @sa_event.listens_for(exclusive, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    try:
        with exclusive.begin() as connection:
            yield connection
    finally:
        exclusive.dispose()
