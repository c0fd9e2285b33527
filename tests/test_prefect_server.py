"""The production path: a real `prefect server` on PostgreSQL, `medic ingest` as a separate process,
the medic store on PostgreSQL too. Proves the run history (flow AND task runs) survives the CLI's exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from sqlalchemy import create_engine, text

from medic.store import Store

pytestmark = pytest.mark.system

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prefect_server(
    tmp_path_factory: pytest.TempPathFactory, postgres_admin_url: str
) -> Iterator[dict[str, str]]:
    database = f"medic_prefect_{uuid.uuid4().hex[:10]}"
    admin = create_engine(postgres_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{database}"'))
    pg_base = postgres_admin_url.rsplit("/", 1)[0].replace("postgresql+psycopg", "postgresql+asyncpg")
    port = _free_port()
    home = tmp_path_factory.mktemp("prefect-home")
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"{pg_base}/{database}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
    }
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
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


def test_ingest_against_prefect_server_on_postgres(
    prefect_server: dict[str, str], postgres_store: Store, tmp_path: Path
) -> None:
    now = datetime.now(UTC).isoformat()
    events = tmp_path / "events.jsonl"
    events.write_text(
        "\n".join(
            json.dumps(
                {
                    "id": f"srv-{uuid.uuid4().hex}",
                    "time": now,
                    "source": "agent",
                    "kind": "xid",
                    "node": "gpu-node-4",
                    "gpu": 1,
                    "attributes": {"code": 48},
                }
            )
            for _ in range(3)
        )
        + "\nnot json\n"
    )
    env = {**prefect_server, "MEDIC_DATABASE_URL": postgres_store.url, "MEDIC_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [str(BIN / "medic"), "ingest", str(events)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "events.jsonl:4" in done.stderr  # the bad line is named and the rest went on

    store = postgres_store
    (incident,) = store.find_incidents(node="gpu-node-4")
    assert (incident.status, incident.action) == ("closed", "reset_gpu")
    assert incident.flow_run_name == f"{incident.id}-gpu-node-4"
    assert len(store.rejections()) == 1

    listed = subprocess.run(
        [str(BIN / "prefect"), "flow-run", "ls"],
        env=prefect_server,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    assert incident.id in listed.stdout

    # Every task run reached the server although `medic ingest` exited right after its flow.
    async def task_runs() -> list[str]:
        async with get_client() as client:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(incident.flow_run_id)]))
            )
            return sorted(r.name.rsplit("-", 1)[0] for r in runs)

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        names = asyncio.run(task_runs())
    # No job ran on the node, so there is no "resume job" stage.
    assert names == sorted(
        ["triage", "decide", "act", "notify", "update", "verify", "update", "update", "close"]
    )
