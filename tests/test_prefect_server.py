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
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterId,
)
from sqlalchemy import create_engine, text

from medic.config import REPO_ROOT
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


def _run(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(args, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_deployment_trigger_runs_incidents_on_a_worker(
    prefect_server: dict[str, str], postgres_store: Store, tmp_path: Path
) -> None:
    """Scaled out: `medic serve --dispatch prefect` opens the incident, the trigger in
    deployments/prefect.yaml starts the run, a process worker on the `medic` pool remediates."""
    env = {
        **prefect_server,
        "MEDIC_DATABASE_URL": postgres_store.url,
        "MEDIC_HOME": str(tmp_path / "home"),
        "MEDIC_REPO": str(REPO_ROOT),
        "MEDIC_INGEST_TOKENS": "scale-out",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
    }
    _run([str(BIN / "prefect"), "work-pool", "create", "medic", "--type", "process"], env)
    _run(
        [
            str(BIN / "prefect"),
            "--no-prompt",
            "deploy",
            "--prefect-file",
            "deployments/prefect.yaml",
            "--all",
        ],
        env,
    )
    port = _free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    processes = [
        subprocess.Popen(
            args,
            env=env,
            cwd=tmp_path,
            stdout=(logs / f"{name}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for name, args in (
            ("worker", [str(BIN / "prefect"), "worker", "start", "--pool", "medic", "--type", "process"]),
            ("serve", [str(BIN / "medic"), "serve", "--port", str(port), "--dispatch", "prefect"]),
        )
    ]

    def logged() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs.iterdir())

    try:
        deadline = time.monotonic() + 60
        while not _answers(f"http://127.0.0.1:{port}/healthz"):
            assert time.monotonic() < deadline, logged()
            time.sleep(0.2)
        event = {
            "id": f"scale-{uuid.uuid4().hex}",
            "time": datetime.now(UTC).isoformat(),
            "source": "agent",
            "kind": "xid",
            "node": "gpu-node-6",
            "gpu": 2,
            "attributes": {"code": 79},
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/events",
            data=json.dumps(event).encode(),
            headers={"Authorization": "Bearer scale-out", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.load(response)["accepted"] == 1
        deadline = time.monotonic() + 150
        while not (
            (found := postgres_store.find_incidents(node="gpu-node-6"))
            and found[0].status in ("closed", "escalated")
        ):
            assert time.monotonic() < deadline, logged()
            time.sleep(0.5)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

    (incident,) = found
    assert (incident.status, incident.action) == ("closed", "reboot")

    async def runs_of_the_deployment() -> list[Any]:
        async with get_client() as client:
            deployment = await client.read_deployment_by_name("remediate-incident/remediate-incident")
            return await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
            )

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        runs = asyncio.run(runs_of_the_deployment())
    (run,) = [r for r in runs if r.parameters.get("incident_id") == incident.id]  # exactly one run
    assert run.parameters == {"incident_id": incident.id, "node": "gpu-node-6"}
    assert run.state is not None and run.state.is_completed()
    assert str(run.id) == incident.flow_run_id  # the worker's run is the one that remediated
    assert "automation" in (run.created_by.type if run.created_by else "").lower()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
