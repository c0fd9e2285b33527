"""Scaled out, end to end: `medic serve --dispatch prefect` stores, correlates and announces the
incident, the trigger in deployments/prefect.yaml (deployed with `prefect deploy`) starts its run,
and a process worker on the `medic` pool remediates. All of it real: a `prefect server` on
PostgreSQL, the medic store on PostgreSQL, the event POSTed over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from bench.prefect_server import answers
from checkout import REPO_ROOT
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import FlowRun
from prefect.events import emit_event
from prefect.events.clients import PrefectEventsClient
from prefect.events.filters import EventFilter, EventIDFilter, EventNameFilter, EventResourceFilter
from prefect.events.schemas.events import ReceivedEvent
from prefect.events.worker import EventsWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from medic.incidents import Incident
from medic.integrations.processes import free_port
from medic.store import Store
from medic.store.tables import IncidentRecord
from medic.tasks.runtime import prefect_events

BIN = Path(sys.executable).parent
NODE = "gpu-node-6"
T = TypeVar("T")


def test_serve_will_not_announce_without_a_prefect_server(tmp_path: Path) -> None:
    """An embedded Prefect server has no workers: no incident announced to it would ever run."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {
        "MEDIC_DISPATCH": "prefect",
        "MEDIC_INGEST_TOKENS": "t",
        "MEDIC_HOME": str(tmp_path / "home"),
        "PREFECT_HOME": str(tmp_path / "prefect"),
    }
    done = subprocess.run(
        [str(BIN / "medic"), "serve", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "PREFECT_API_URL" in done.stderr


@pytest.mark.system
def test_the_trigger_runs_each_announced_incident_once_on_a_worker(
    prefect_server: dict[str, str], postgres_store: Store, tmp_path: Path
) -> None:
    api = prefect_server["PREFECT_API_URL"]
    env = prefect_server | {
        "MEDIC_DATABASE_URL": postgres_store.url,
        "MEDIC_HOME": str(tmp_path / "home"),
        "MEDIC_INGEST_TOKENS": "scale-out",
        "PREFECT_WORKER_QUERY_SECONDS": "1",  # Prefect's default is 10 s
    }
    _prefect_cli(["work-pool", "create", "medic", "--type", "process"], env, cwd=tmp_path)
    # Deployed and run away from the checkout: the worker imports the installed package.
    prefect_file = str(REPO_ROOT / "deployments" / "prefect.yaml")
    _prefect_cli(["--no-prompt", "deploy", "--prefect-file", prefect_file, "--all"], env, cwd=tmp_path)
    port = free_port()
    commands = {
        "worker": [str(BIN / "prefect"), "worker", "start", "--pool", "medic", "--type", "process"],
        "serve": [str(BIN / "medic"), "serve", "--port", str(port), "--dispatch", "prefect"],
    }
    with _running(commands, env, tmp_path / "logs") as logged:
        _until("medic serve", lambda: answers(f"http://127.0.0.1:{port}/healthz"), 60, logged)
        _post_xid_79(port)
        incident = _until(
            "the incident", lambda: next(iter(postgres_store.find_incidents(node=NODE)), None), 30, logged
        )
        _until("the trigger's flow run", lambda: _runs_of(api, incident.id), 30, logged)
        # The same announcement once more (a resend, a replay): Prefect drops it by its id.
        sent_after = _announce_again(api, postgres_store, incident.id)
        marker = EventFilter(id=EventIDFilter(id=[sent_after]))
        _until("the event sent after it", lambda: _events(api, marker), 30, logged)
        settled = _until("the incident closed", lambda: _settled(postgres_store, incident.id), 120, logged)
        # The flow closes the incident in the store a moment before its run ends.
        _until("the run's end", lambda: all(_ended(r) for r in _runs_of(api, incident.id)), 30, logged)

    assert (settled.status, settled.action) == ("closed", "reboot")
    (run,) = _runs_of(api, incident.id)  # exactly one flow run for the incident on the server

    async def deployment_and_automation(client: PrefectClient) -> tuple[Any, list[Any]]:
        deployment = await client.read_deployment_by_name("remediate-incident/remediate-incident")
        automations = await client.read_resource_related_automations(f"prefect.deployment.{deployment.id}")
        return deployment, automations

    deployment, automations = _prefect(api, deployment_and_automation)
    (automation,) = automations
    assert run.deployment_id == deployment.id
    assert run.created_by is not None
    assert (run.created_by.type, run.created_by.id) == ("AUTOMATION", automation.id)
    assert run.parameters == {"incident_id": incident.id, "node": NODE}  # templated from the labels
    assert run.work_pool_name == "medic" and run.infrastructure_pid  # a worker started its process
    assert run.state is not None and run.state.is_completed()
    assert str(run.id) == settled.flow_run_id  # and that run is the one that remediated
    # The service drained the node before the worker's run began; that run found it drained.
    detail = postgres_store.incident_detail(incident.id)
    assert detail is not None
    contained, triaged = (next(s for s in detail.steps if s.stage == name) for name in ("contain", "triage"))
    assert (contained.status, contained.summary) == ("ok", f"drained {NODE}")
    assert contained.finished_at <= triaged.started_at
    assert sorted(a.action for a in detail.actions) == ["drain", "reboot", "resume"]

    # One announcement in Prefect's feed, with its fixed id: the flow run did not announce again.
    opened_filter = EventFilter(
        event=EventNameFilter(name=["medic.incident.opened"]),
        resource=EventResourceFilter(id=[f"medic.incident.{incident.id}"]),
    )
    (opened,) = _events(api, opened_filter)
    assert opened.id == prefect_events.event_id("medic.incident.opened", incident.id)
    assert (opened.resource["medic.incident"], opened.resource["medic.node"]) == (incident.id, NODE)


def _prefect_cli(args: list[str], env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(
        [str(BIN / "prefect"), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr


@contextmanager
def _running(commands: dict[str, list[str]], env: dict[str, str], logs: Path) -> Iterator[Callable[[], str]]:
    """The commands as processes, each logging to a file; yields what they logged so far."""
    logs.mkdir()
    processes = [
        subprocess.Popen(
            args, env=env, cwd=logs, stdout=(logs / f"{name}.log").open("w"), stderr=subprocess.STDOUT
        )
        for name, args in commands.items()
    ]
    try:
        yield lambda: "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs.glob("*.log"))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def _until(what: str, check: Callable[[], T | None], timeout_s: float, logged: Callable[[], str]) -> T:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s\n{logged()}"
        time.sleep(0.5)
    return found


def _post_xid_79(port: int) -> None:
    event = {
        "id": f"scale-{uuid.uuid4().hex}",
        "time": datetime.now(UTC).isoformat(),
        "source": "agent",
        "kind": "xid",
        "node": NODE,
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


def _ended(run: FlowRun) -> bool:
    return run.state is not None and run.state.is_final()


def _settled(store: Store, incident_id: str) -> IncidentRecord | None:
    record = store.get_incident(incident_id)
    return record if record is not None and record.status in ("closed", "escalated") else None


def _announce_again(api: str, store: Store, incident_id: str) -> uuid.UUID:
    """Send the incident's announcement, then a marker event; returns the marker's id."""
    incident = Incident(id=incident_id, node=NODE, events=store.incident_events(incident_id))
    # Prefect's event worker is shared per client type; this one sends to this test's server only.
    EventsWorker.set_client_override(PrefectEventsClient, api_url=api)
    try:
        with temporary_settings({PREFECT_API_URL: api}):
            prefect_events.incident_opened(incident)
            # Sent after it on the same connection: once the marker is stored, the announcement
            # reached the server too (and was dropped there, not on the way).
            marker = emit_event(
                "medic.test.sent", resource={"prefect.resource.id": f"medic.test.{incident_id}"}
            )
            assert marker is not None and EventsWorker.instance().drain()
    finally:
        EventsWorker.set_client_override(None)
    return marker.id


def _prefect(api: str, call: Callable[[PrefectClient], Awaitable[T]]) -> T:
    async def run() -> T:
        async with PrefectClient(api) as client:
            return await call(client)

    return asyncio.run(run())


def _runs_of(api: str, incident_id: str) -> list[FlowRun]:
    """Every flow run on the server for this incident, whoever created it."""

    async def read(client: PrefectClient) -> list[FlowRun]:
        return [r for r in await client.read_flow_runs() if r.parameters.get("incident_id") == incident_id]

    return _prefect(api, read)


def _events(api: str, wanted: EventFilter) -> list[ReceivedEvent]:
    async def read(client: PrefectClient) -> list[ReceivedEvent]:
        return (await client.read_events(filter=wanted, limit=10)).events

    return _prefect(api, read)
