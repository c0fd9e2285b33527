"""The store's engine and sessions: one SQLAlchemy URL, SQLite by default, PostgreSQL in production.

Every mixin of `Store` (medic/store/store.py) builds on `StoreBase`: a method opens its own
short session and commits before it returns, so a caller never holds a transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.schema import CreateIndex
from sqlmodel import Session, SQLModel, create_engine

log = logging.getLogger(__name__)


def utcnow() -> datetime:
    return datetime.now(UTC)


def _sqlite_pragmas(engine: Engine) -> None:
    # WAL: concurrent readers while a flow writes, and ~5x faster single-row commits.
    @sa_event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=10000")
        cursor.close()


# Any fixed 64-bit number: the key of the advisory lock GPU Medic's processes create the schema under.
_SCHEMA_LOCK_KEY = 0x6D65646963  # "medic"


@contextmanager
def _schema_lock(engine: Engine) -> Iterator[None]:
    """One process at a time creates or upgrades the schema. `create_all` looks for a table and then
    creates it, and two replicas starting together on an empty PostgreSQL database both create it:
    one fails on PostgreSQL's catalog. SQLite serialises writers itself."""
    if engine.dialect.name != "postgresql":
        yield
        return
    with engine.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
        try:
            yield
        finally:
            holder.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _SCHEMA_LOCK_KEY})
            holder.commit()


def _ensure_columns(engine: Engine) -> None:
    """Nullable columns added since a table was first created: `create_all` leaves existing tables
    as they are, and a store written by an earlier release must keep working after an upgrade."""
    existing = inspect(engine)
    for table in SQLModel.metadata.sorted_tables:
        have = {c["name"] for c in existing.get_columns(table.name)}
        for column in table.columns:
            if column.name in have or not column.nullable:
                continue
            kind = column.type.compile(dialect=engine.dialect)
            try:
                with engine.begin() as connection:
                    connection.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'))
            except DBAPIError:
                # Another process starting at the same moment added it first.
                if column.name not in {c["name"] for c in inspect(engine).get_columns(table.name)}:
                    raise


def _ensure_indexes(engine: Engine) -> None:
    """Indexes added since a table was first created: `create_all` makes them only with the table."""
    for table in SQLModel.metadata.sorted_tables:
        for index in table.indexes:
            try:
                with engine.begin() as connection:
                    connection.execute(CreateIndex(index, if_not_exists=True))
            except IntegrityError as error:  # rows written before the index break it: say so, go on
                log.warning("store index %s not created: %s", index.name, error.orig)


class StoreBase:
    def __init__(self, url: str) -> None:
        self.url = url
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.engine = create_engine(url, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            _sqlite_pragmas(self.engine)
        with _schema_lock(self.engine):
            SQLModel.metadata.create_all(self.engine)
            _ensure_columns(self.engine)
            _ensure_indexes(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session:
            yield session

    def ping(self) -> None:
        """Raise unless the database answers."""
        with self.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
