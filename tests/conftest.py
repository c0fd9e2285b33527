"""Shared fixtures: a real Prefect (test harness, or a `prefect server` on PostgreSQL), real SQLite
and real PostgreSQL stores."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy.exc import OperationalError

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# No backend falls back to the simulation (docs/config.md): the suite chooses it, for itself and for
# every `medic` it starts. A test about a real backend names it (MEDIC_SCHEDULER=slurm, ...).
os.environ["MEDIC_BACKENDS"] = "sim"
# The reference job's runs here mean CPU and gloo, even on a machine with a GPU; one that means the
# GPU says TRAIN_DEVICE=cuda (or auto).
os.environ.setdefault("TRAIN_DEVICE", "cpu")
# The CLI's consoles take their width from COLUMNS when they are made, at import: set then (as by
# pytest-xdist's workers, to 80) it would fold the ids and rules that the CLI tests look for. Unset,
# each test's own COLUMNS applies.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

from checkout import REPO_ROOT

from medic.integrations import registry
from medic.integrations.registry import Backends
from medic.integrations.sim.fleet import SimFleet
from medic.store import Store
from medic.tasks.runtime.process import Runtime, configure

if TYPE_CHECKING:
    from medic.flows.leases import Leases
    from medic.flows.live import LiveDispatcher

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
    services automations need (tests/bench/prefect_server.py). Yields the environment of its clients:
    `PREFECT_API_URL` and a `PREFECT_HOME` of their own."""
    from bench.prefect_server import prefect_on_postgres

    home = tmp_path_factory.mktemp("prefect-home")
    with prefect_on_postgres(home / "server", postgres_admin_url) as api:
        yield {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }


@pytest.fixture
def live_dispatcher() -> Iterator[Callable[..., LiveDispatcher]]:
    """Makes the warm path's dispatchers, closed after the test: a lease still held would be
    renewed from a thread of this process against a store the test has dropped."""
    from medic.flows.live import LiveDispatcher

    made: list[LiveDispatcher] = []

    def make(rt: Runtime, leases: Leases | None = None) -> LiveDispatcher:
        made.append(LiveDispatcher(rt, leases))
        return made[-1]

    yield make
    for dispatcher in made:
        dispatcher.close()


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

    tables = ", ".join(f'"{t.name}"' for t in SQLModel.metadata.sorted_tables)
    for attempt in range(5):
        try:
            with store.engine.begin() as conn:
                conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY"))
            break
        except OperationalError as error:
            # A test's server or worker still winding down may hold one of the tables: PostgreSQL
            # picks one of the two as a deadlock's victim, and the truncate is safe to repeat.
            if "deadlock" not in str(error.orig) or attempt == 4:
                raise
            time.sleep(0.5)
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


# --- no credential in any log record of the session (issue 15) -------------------------------

CREDENTIAL_ENV = (
    "MEDIC_INGEST_TOKENS",
    "MEDIC_INGEST_HMAC_SECRET",
    "MEDIC_SENTRY_CLIENT_SECRET",
    "SLACK_SIGNING_SECRET",
    "SLACK_BOT_TOKEN",
    "PREFECT_API_KEY",
)


class CredentialsInLogs(logging.Handler):
    """Every record logged in this process, searched for the credentials the environment holds when
    it is logged (tests set them with monkeypatch): a find fails the session and is named.
    tests/entrypoints/test_no_secrets_in_logs.py does the same for everything a `medic serve` process writes."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        secrets = {
            value.strip(): name
            for name in CREDENTIAL_ENV
            for value in os.environ.get(name, "").split(",")
            if len(value.strip()) >= 8  # shorter is no real secret, and would match by chance
        }
        if not secrets:
            return
        text = logging.Formatter().format(record)  # the message and any traceback
        self.found += [
            f"{record.name} at {record.pathname}:{record.lineno}: {n}"
            for v, n in secrets.items()
            if v in text
        ]


_credentials_in_logs = CredentialsInLogs()


def pytest_configure(config: pytest.Config) -> None:
    logging.getLogger().addHandler(_credentials_in_logs)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _credentials_in_logs.found:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _credentials_in_logs.found:
        terminalreporter.section("credentials in log records", red=True)
        for found in _credentials_in_logs.found:
            terminalreporter.line(found)


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """For a CLI command run in-process: the shipped policy, a home of the test's own, and lines wide
    enough that rich never folds a file name in two."""
    monkeypatch.delenv("MEDIC_POLICY", raising=False)
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "400")
