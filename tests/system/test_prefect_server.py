"""The production path: a real `prefect server` on PostgreSQL, `medic ingest` as a separate process,
the medic store on PostgreSQL too. Proves the run history (flow AND task runs) survives the CLI's exit.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from medic.store import Store

pytestmark = pytest.mark.system

BIN = Path(sys.executable).parent


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
            return sorted(r.name for r in runs)

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        names = asyncio.run(task_runs())
    # No job ran on the node, so there is no "resume job" stage; chat messages are no task runs
    # (medic/tasks/notify.py's worker sends them beside the stages).
    # Each named for what it did.
    assert names == sorted(
        [
            f"triage {incident.id}",
            f"decide {incident.id}",
            "act: reset_gpu gpu-node-4",
            "verify L1 gpu-node-4",
            f"close {incident.id}: closed",
        ]
    )
