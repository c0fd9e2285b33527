"""`medic serve` stopped while an incident waits for a human: it exits within 10 s, and the next
start takes the incident up again, still waiting for the answer (never acting without it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from checkout import REPO_ROOT
from sqlalchemy import text
from test_server import BEARER, ev, free_port, server_process

from medic.statuses import IncidentStatus
from medic.store import Store

POLICY = REPO_ROOT / "policies" / "default.yaml"


def _status(database: Path, node: str) -> tuple[str, str | None] | None:
    store = Store(f"sqlite:///{database}")
    try:
        with store.session() as s:
            row = s.exec(
                text("SELECT status, runner FROM incidents WHERE node = :node"), params={"node": node}
            ).first()
    finally:
        store.close()
    return None if row is None else (row[0], row[1])


def _await_status(database: Path, node: str, status: str, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    while True:
        found = _status(database, node)
        if found is not None and found[0] == status:
            return found[1]
        assert time.monotonic() < deadline, f"incident on {node} is {found}, not {status!r}"
        time.sleep(0.2)


def test_sigterm_while_waiting_for_approval_exits_fast_and_a_restart_waits_again(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        POLICY.read_text().replace("required_for: [replace]", "required_for: [reboot, replace]")
    )
    env = {
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": "",
        "MEDIC_BACKENDS": "sim",
        "MEDIC_POLICY": str(policy),
    }
    database, port = tmp_path / "medic.db", free_port()
    with server_process(database, port, env) as process:
        body = ev("approval-1", node="gpu-node-3")  # XID 79: the default policy reboots
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/events", json=body, headers=BEARER, timeout=30)
        assert answer.status_code == 200
        first = _await_status(database, "gpu-node-3", IncidentStatus.WAITING_FOR_APPROVAL, 120)
        process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        process.wait(timeout=30)
        took = time.monotonic() - stopped
    assert process.returncode == 128 + signal.SIGTERM
    assert took < 10, f"medic serve took {took:.1f} s to stop while waiting for approval"
    assert _status(database, "gpu-node-3") == (IncidentStatus.WAITING_FOR_APPROVAL, first)

    # Same port: its predecessor's incident is taken back at the first pickup, not after a lease.
    with server_process(database, port, env) as restarted:
        second = _await_status(database, "gpu-node-3", IncidentStatus.WAITING_FOR_APPROVAL, 120)
        deadline = time.monotonic() + 60
        while second == first:
            assert time.monotonic() < deadline, "the restarted service never took the incident up"
            time.sleep(0.2)
            second = _await_status(database, "gpu-node-3", IncidentStatus.WAITING_FOR_APPROVAL, 5)
        assert second is not None and second.rsplit(":", 1)[1] == str(restarted.pid)
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(timeout=30)
    store = Store(f"sqlite:///{database}")
    with store.session() as s:
        actions = list(s.exec(text("SELECT action FROM actions WHERE action = 'reboot'")).scalars())
    store.close()
    assert actions == []  # no answer came: the node was never rebooted


def test_serve_refuses_to_start_when_no_policy_loads(tmp_path: Path) -> None:
    broken = tmp_path / "policy.yaml"
    broken.write_text("rules: [\n")
    env = os.environ | {
        "MEDIC_DATABASE_URL": f"sqlite:///{tmp_path / 'medic.db'}",
        "MEDIC_INGEST_TOKENS": "t",
        "MEDIC_POLICY": str(broken),
        "PREFECT_HOME": str(tmp_path / "prefect"),
    }
    code = "import typer; from medic.apps.cli.serve import serve; typer.run(serve)"
    done = subprocess.run(
        [sys.executable, "-c", code, "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"{broken}:" in done.stderr and "cannot be loaded" in done.stderr
