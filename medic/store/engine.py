"""The store's engine and sessions: one SQLAlchemy URL, SQLite by default, PostgreSQL in production.

Every mixin of `Store` (medic/store/store.py) builds on `StoreBase`: a method opens its own
short session and commits before it returns, so a caller never holds a transaction; the commit
appends what it wrote to the audit chain (medic/store/ledger.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy import exc, text
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, create_engine

from medic import config
from medic.store import ledger, migrate, sqlite
from medic.store.chain import ChainKey


def unavailable(error: BaseException) -> bool:
    """Whether `error` says the database did not answer (down, unreachable, out of connections, not a
    database any more), not that a statement was wrong: what was asked may be asked again later."""
    if isinstance(error, exc.TimeoutError | exc.DisconnectionError):  # the pool: no connection to be had
        return True
    wrong = exc.IntegrityError | exc.DataError | exc.ProgrammingError | exc.NotSupportedError
    return isinstance(error, exc.DBAPIError) and not isinstance(error, wrong)


def utcnow() -> datetime:
    return datetime.now(UTC)


def _sqlite_pragmas(engine: Engine) -> None:
    @sa_event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        sqlite.prepare(dbapi_connection, busy_timeout_ms=10_000)


class StoreBase:
    def __init__(self, url: str, audit_key: str | None = None) -> None:
        """Open the store at `url`, migrating it to this release's schema first (medic/store/migrate.py).
        Its audit chain is keyed with `audit_key`, by default MEDIC_AUDIT_KEY (medic/config.py)."""
        self.url = url
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.engine = create_engine(url, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            _sqlite_pragmas(self.engine)
        self.audit_key = ChainKey.of(audit_key or config.audit_key())
        migrate.upgrade(self.engine, self.audit_key)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session whose writes to audited tables are sealed in the audit chain when it commits."""
        with ledger.open_session(self.engine, self.audit_key) as session:
            yield session

    @contextmanager
    def snapshot(self) -> Iterator[Connection]:
        """A connection that sees the store as of its first read until it closes, while writers go
        on: a check that reads a row's entry and then the row must not see the row changed between."""
        with self.engine.connect() as connection:
            if self.engine.dialect.name == "postgresql":
                connection.execution_options(isolation_level="REPEATABLE READ")
            elif self.engine.dialect.name == "sqlite":
                connection.exec_driver_sql("BEGIN")  # pysqlite itself begins only before a write
            yield connection

    def ping(self) -> None:
        """Raise unless the database answers."""
        with self.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
