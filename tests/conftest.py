"""Shared fixtures: a real Prefect (test harness, or a `prefect server` on PostgreSQL), real SQLite
and real PostgreSQL stores."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from integrations import registry
from integrations.processes import free_port
from integrations.registry import Backends
from integrations.sim.fleet import SimFleet
from medic.config import REPO_ROOT
from medic.store import Store
from tasks.runtime import Runtime, configure

POSTGRES_ADMIN_URL = os.environ.get(
    "MEDIC_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One real (temporary) Prefect server for the whole session: entering it costs ~15 s."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def prefect_server(
    tmp_path_factory: pytest.TempPathFactory, postgres_admin_url: str
) -> Iterator[dict[str, str]]:
    """A `prefect server` process on a PostgreSQL database of its own, as a fleet runs it, with the
    services automations need (events stored, triggers and their actions). Yields the environment
    of its clients: `PREFECT_API_URL` and a `PREFECT_HOME` of their own."""
    from sqlalchemy import create_engine, text

    database = f"medic_prefect_{uuid.uuid4().hex[:10]}"
    admin = create_engine(postgres_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{database}"'))
    pg_base = postgres_admin_url.rsplit("/", 1)[0].replace("postgresql+psycopg", "postgresql+asyncpg")
    port = free_port()
    home = tmp_path_factory.mktemp("prefect-home")
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"{pg_base}/{database}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "true",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "true",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
    }
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "prefect"),
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"prefect server did not start:\n{(home / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)
    client_env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    yield client_env
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    store = Store(f"sqlite:///{tmp_path / 'medic.db'}")
    yield store
    store.close()


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    return POSTGRES_ADMIN_URL


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, dropped afterwards."""
    from sqlalchemy import create_engine, text

    name = f"medic_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    yield url
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def postgres_store(postgres_url: str) -> Iterator[Store]:
    store = Store(postgres_url)
    yield store
    # Each test starts empty: truncate rather than recreate, it is much faster.
    from sqlalchemy import text
    from sqlmodel import SQLModel

    with store.engine.begin() as conn:
        tables = ", ".join(f'"{t.name}"' for t in SQLModel.metadata.sorted_tables)
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY"))
    store.close()


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest) -> Store:
    """Every store test runs on both databases."""
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
def fleet() -> SimFleet:
    return SimFleet.build(nodes=8)


@pytest.fixture
def sim_backends(fleet: SimFleet) -> Backends:
    return registry.simulated(fleet)[0]


@pytest.fixture
def runtime(store: Store, sim_backends: Backends) -> Runtime:
    return configure(Runtime(store, sim_backends, DEFAULT_POLICY))
