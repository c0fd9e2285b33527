"""A real `prefect server` on a PostgreSQL database of its own, as a fleet runs it.

Shared by the benchmarks and the system tests: the services automations need are on (events
stored, triggers and their actions), so a deployment trigger fires as in production.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DEFAULT_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@contextmanager
def fresh_database(admin_url: str = DEFAULT_ADMIN_URL, prefix: str = "medic_bench") -> Iterator[str]:
    """A new PostgreSQL database (its SQLAlchemy URL, as `admin_url`'s driver); dropped afterwards."""
    from sqlalchemy import create_engine, text

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def prefect_on_postgres(home: Path, admin_url: str = DEFAULT_ADMIN_URL, *, ui: bool = False) -> Iterator[str]:
    """Start the server (its PREFECT_HOME: `home`) on a fresh database; yield its API URL; then
    stop it and drop the database. With `ui`, it also serves the web UI, pointed at its own API."""
    with fresh_database(admin_url, "medic_prefect") as database:
        yield from _serve(home, database.replace("postgresql+psycopg", "postgresql+asyncpg"), ui)


def _serve(home: Path, database: str, ui: bool) -> Iterator[str]:
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": database,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": str(ui).lower(),
        # Off port 4200 the UI would call an API that is not there: it must be told this one.
        **({"PREFECT_UI_API_URL": api} if ui else {}),
        "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "true",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "true",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
    }
    env.pop("PREFECT_API_URL", None)
    home.mkdir(parents=True, exist_ok=True)
    log = home / "server.log"
    with log.open("wb") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while not answers(f"{api}/health"):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"prefect server did not start:\n{log.read_text(errors='replace')[-3000:]}"
                )
            time.sleep(0.5)
        yield api
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def answers(url: str) -> bool:
    """Whether a GET of `url` is answered 200 now."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
