"""The store's schema under alembic (medic/store/migrate.py): a store of the release before is brought
to the head and its rows sealed, the head is exactly medic/store/tables.py, replicas starting together
migrate once, and a store newer than this release is refused; on SQLite and PostgreSQL."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from audit_support import sql, work_incident
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, SQLModel

from medic.store import Store, utcnow
from medic.store.migrate import HEAD, SCRIPTS, VERSION_TABLE, SchemaError
from medic.store.migrations import baseline
from medic.store.tables import (
    ActionRecord,
    ApprovalRecord,
    BreakerRecord,
    DecisionRecord,
    EventRecord,
    IncidentRecord,
    StepRecord,
)


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database nothing has touched."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'medic.db'}"
        return
    admin_url = request.getfixturevalue("postgres_admin_url")
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    name = f"medic_migrate_{uuid.uuid4().hex[:10]}"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def write_as_the_previous_release(url: str) -> int:
    """The previous release's store: its schema made by `create_all`, no version, no ledger, and
    rows written through plain sessions, as its code wrote them. Returns how many rows."""
    engine = create_engine(url)
    baseline.METADATA.create_all(engine)
    at = utcnow() - timedelta(days=2)
    rows: list[SQLModel] = [
        IncidentRecord(id="inc-p", node="gpu-node-1", opened_at=at, last_event_at=at, jobs=["j-1"]),
        EventRecord(
            id="p-1",
            time=at,
            received_at=at,
            source="agent",
            kind="xid",
            node="gpu-node-1",
            attributes={"code": 79},
            incident_id="inc-p",
        ),
        EventRecord(id="p-2", time=at, received_at=at, source="agent", kind="remediation", node="gpu-node-9"),
        StepRecord(
            incident_id="inc-p", stage="triage", started_at=at, finished_at=at, status="ok", detail={"n": 1}
        ),
        DecisionRecord(
            incident_id="inc-p",
            decided_at=at,
            policy_path="p.yaml",
            policy_sha256="ab" * 32,
            rule="r",
            classification="hardware",
            action="reboot",
            reason="XID 79",
            matched=["r"],
            facts={"now": "x"},
        ),
        ActionRecord(
            key="inc-p:gpu-node-1:reboot",
            incident_id="inc-p",
            node="gpu-node-1",
            action="reboot",
            status="succeeded",
            attempts=1,
            intent_at=at,
            finished_at=at,
        ),
        ApprovalRecord(
            incident_id="inc-p", action="reboot", requested_at=at, answered_at=at, approved=True, by="al"
        ),
        BreakerRecord(opened_at=at, reason="storm", closed_at=at, closed_by="bo"),
    ]
    # Through the previous schema's tables: a column added since (decisions.mode) is not in them.
    with engine.begin() as connection:
        for row in rows:
            table = baseline.METADATA.tables[str(row.__tablename__)]
            values = {
                k: v for k, v in row.model_dump().items() if k in table.c and not (k == "id" and v is None)
            }
            connection.execute(table.insert().values(**values))
    engine.dispose()
    return len(rows)


def test_a_store_of_the_previous_release_is_upgraded_sealed_and_chains_on(empty_url: str) -> None:
    written = write_as_the_previous_release(empty_url)

    store = Store(empty_url)

    assert sql(store, f"SELECT version_num FROM {VERSION_TABLE}") == HEAD
    sealed = store.verify_chain()
    assert sealed.ok, [p.describe() for p in sealed.problems]
    assert sealed.entries == sealed.rows == written
    order = [
        r for r in store.engine.connect().execute(text("SELECT table_name FROM audit_chain ORDER BY seq"))
    ]
    assert [t for (t,) in order] == [
        "incidents",
        "events",
        "events",
        "steps",
        "decisions",
        "actions",
        "approvals",
        "breaker",
    ]
    work_incident(store, "inc-new", "gpu-node-2", utcnow(), close=True)
    store.update_incident("inc-p", status="closed", closed_at=utcnow())
    after = store.verify_chain()
    assert after.ok and after.entries > written
    store.close()


def test_the_migrated_schema_is_the_one_tables_py_describes(empty_url: str) -> None:
    store = Store(empty_url)
    context = {"version_table": VERSION_TABLE}
    # SQLite's indexes on an expression cannot be reflected: alembic says so, and skips the breaker's.
    with store.engine.connect() as connection, warnings.catch_warnings(action="ignore"):
        differences = compare_metadata(
            MigrationContext.configure(connection, opts=context), SQLModel.metadata
        )
    store.close()
    assert differences == []


def test_opening_a_migrated_store_again_changes_nothing(empty_url: str) -> None:
    Store(empty_url).close()
    store = Store(empty_url)
    assert sql(store, f"SELECT count(*) FROM {VERSION_TABLE}") == 1
    assert sql(store, "SELECT count(*) FROM audit_chain") == 0
    store.close()


def test_the_named_head_is_the_newest_revision() -> None:
    assert ScriptDirectory(str(SCRIPTS)).get_current_head() == HEAD


def test_a_migrated_store_opens_without_loading_alembic(empty_url: str) -> None:
    Store(empty_url).close()
    opened = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from medic.store import Store; Store(sys.argv[1]).close(); print('alembic' in sys.modules)",
            empty_url,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert opened.stdout.split() == ["False"]


def test_a_store_newer_than_this_release_is_refused(empty_url: str) -> None:
    Store(empty_url).close()
    engine = create_engine(empty_url)
    with engine.begin() as connection:
        connection.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '9999'"))
    engine.dispose()
    with pytest.raises(SchemaError, match="newer than this release"):
        Store(empty_url)


def _open(url: str, start: multiprocessing.synchronize.Barrier) -> None:
    start.wait()
    Store(url).close()


def test_replicas_opening_an_empty_store_at_once_migrate_it_once(empty_url: str) -> None:
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(3)
    openers = [context.Process(target=_open, args=(empty_url, start)) for _ in range(3)]
    for opener in openers:
        opener.start()
    for opener in openers:
        opener.join(120)
        assert opener.exitcode == 0
    store = Store(empty_url)
    assert sql(store, f"SELECT version_num FROM {VERSION_TABLE}") == HEAD
    store.close()


def test_a_unique_index_its_rows_break_is_created_once_they_allow_it(
    empty_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = create_engine(empty_url)
    baseline.METADATA.create_all(engine)
    at = utcnow()
    with engine.begin() as connection:
        connection.execute(text("DROP INDEX uq_incidents_one_active"))
    with Session(engine) as session:  # two runs that died before incidents had leases
        session.add_all(IncidentRecord(id=i, node="gpu-node-1", opened_at=at, last_event_at=at) for i in "ab")
        session.commit()
    engine.dispose()

    store = Store(empty_url)
    assert "uq_incidents_one_active not created" in caplog.text
    assert store.verify_chain().ok
    store.update_incident("a", status="escalated")
    store.close()

    again = Store(empty_url)  # the next start creates the index: the rows allow it now
    with pytest.raises(IntegrityError):
        sql(again, "UPDATE incidents SET status = 'open' WHERE id = 'a'")
    again.close()
