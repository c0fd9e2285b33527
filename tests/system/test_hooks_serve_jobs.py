"""A job's signals reach `medic serve` as a site wires them: the reference training job under a real
torchrun (3 ranks on the CPU, gloo, standing for 2 nodes), its hooks pointed at an authenticated
`medic serve` over HTTP (`--events URL`, the token from MEDIC_TOKEN_FILE), rank 1 slowed by a named
cause. serve names the straggler from the ranks' step timings, writes the pair's profile requests
under MEDIC_ARTIFACT_ROOT, the two ranks profile the same steps and report them over HTTP, serve
diffs them; the stragglers wait for the verdict and carry it, and the slow rank is one incident: a
hot spot in the job's Python or a starved data loader leaves the node in service, a slower compute
operator takes it out (docs/decisions/0024). And a job hung in one collective is named from the stall
reports its hooks post. Nothing here reads the job's
files: all of it went through the intake (a crash and a refused token: tests/entrypoints/test_hooks_to_serve.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from bench.resume import job_command
from serve_process import TOKEN, free_port, server_process
from sqlalchemy import text

from medic.integrations.processes import descendants, kill
from medic.store import Store

pytestmark = pytest.mark.system

SUSPECT = 1  # on gpu-node-2 with rank 2; rank 0 alone on gpu-node-1: the peer elsewhere
GIVE_UP_S = 180  # launch ~7 s, the pair's lead 15 s, the profiles, their POSTs and a diff
SLOW_AFTER_S = 10.0


@contextmanager
def running(tmp_path: Path, command: list[str]) -> Iterator[subprocess.Popen[str]]:
    """The job under torchrun as a site starts it: its token in a file named by MEDIC_TOKEN_FILE, none
    in its arguments or its environment; killed, with every rank, on the way out."""
    secret = tmp_path / "medic-token"
    secret.write_text(TOKEN + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_DEVICE": "cpu", "MEDIC_TOKEN_FILE": str(secret)}
    env.pop("MEDIC_TOKEN", None)
    with (tmp_path / "torchrun.log").open("w") as log:
        job = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
    try:
        yield job
    finally:
        stop(job)


def stop(job: subprocess.Popen[str]) -> None:
    """The job and every rank it started (again: a no-op)."""
    for pid in [*descendants(job.pid), job.pid]:
        kill(pid)
    job.wait()


def events_of(database: Path, kind: str) -> list[dict[str, Any]]:
    store = Store(f"sqlite:///{database}")
    try:
        with store.session() as s:
            rows = s.exec(
                text("SELECT id, node, rank, attributes FROM events WHERE kind = :kind ORDER BY time"),
                params={"kind": kind},
            ).all()
    finally:
        store.close()
    # A JSON column read back by plain SQL: text on SQLite.
    return [
        {
            "id": r[0],
            "node": r[1],
            "rank": r[2],
            "attributes": json.loads(r[3]) if isinstance(r[3], str) else r[3] or {},
        }
        for r in rows
    ]


def incidents(database: Path) -> list[tuple[str, str, str, str, str | None]]:
    store = Store(f"sqlite:///{database}")
    try:
        with store.session() as s:
            rows = s.exec(text("SELECT id, node, classification, action, closed_at FROM incidents")).all()
            acted = s.exec(text("SELECT incident_id, action, status FROM actions")).all()
    finally:
        store.close()
    return [(*row, ",".join(sorted(a[1] for a in acted if a[0] == row[0]))) for row in rows]  # type: ignore[return-value]


def settled(database: Path, timeout_s: float = 90) -> list[tuple[str, str, str, str, str | None]]:
    """The incidents once none is still being handled (a diagnostic runs on after the job is gone)."""
    deadline = time.monotonic() + timeout_s
    while (found := incidents(database)) and any(row[4] is None for row in found):
        assert time.monotonic() < deadline, found
        time.sleep(0.5)
    return found


def verdict(database: Path, job: subprocess.Popen[str]) -> dict[str, Any]:
    began = time.monotonic()
    while time.monotonic() - began < GIVE_UP_S and job.poll() is None:
        for straggler in events_of(database, "straggler"):
            if "straggler_cause" in straggler["attributes"]:
                return straggler
        time.sleep(0.5)
    raise AssertionError(f"no straggler with a cause stored (job exit {job.poll()}; see torchrun.log)")


CASES = {
    # cause: (--inject-ms, the verdict, the incident's classification and action, the node actions)
    "python": (5, "software-python", "software", "none", ""),
    "input": (20, "software-input", "software", "none", ""),
    "compute": (4, "hardware-compute", "hardware", "reintegrate", "drain,resume"),
}


@pytest.mark.parametrize("cause", CASES)
def test_a_jobs_hooks_over_http_to_an_authenticated_serve_name_the_straggler_and_why(
    tmp_path: Path, cause: str
) -> None:
    inject_ms, expected, classification, action, node_actions = CASES[cause]
    database, port = tmp_path / "medic.db", free_port()
    env = {
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": "",
        "MEDIC_BACKENDS": "sim",
        "MEDIC_ARTIFACT_ROOT": str(tmp_path),
    }
    command = [
        *[arg for arg in job_command(tmp_path, 3) if not arg.startswith("--events=")],
        f"--events=http://127.0.0.1:{port}/v1/events",
        f"--artifacts={tmp_path / 'artifacts'}",
        "--steps=100000",  # stopped once the verdict is out
        "--ckpt-every=100000",
        "--stall-dump-s=0",
        "--timings-every=10",
        "--node-of-rank=gpu-node-1,gpu-node-2,gpu-node-2",
        "--batch-size=48",
        f"--inject-slow={cause}",
        f"--inject-rank={SUSPECT}",
        f"--inject-ms={inject_ms}",
    ]
    with server_process(database, port, env), running(tmp_path, command) as job:
        straggler = verdict(database, job)
        time.sleep(SLOW_AFTER_S)  # still slow: its reports keep coming, and join its incident
        stop(job)  # then what serve made of it, once its incidents are settled
        timings = events_of(database, "health_check")
        opened = settled(database)
    assert (straggler["rank"], straggler["node"]) == (SUSPECT, "gpu-node-2")
    attributes = straggler["attributes"]
    assert attributes["straggler_cause"] == expected, attributes.get("straggler_cause_reason")
    if cause == "python":
        assert "injected_hot_spot" in attributes["straggler_cause_where"]
    # One incident, decided on the verdict: every straggler waited for it, and the later ones joined.
    assert [(node, c, a, acted) for _, node, c, a, _, acted in opened] == [
        ("gpu-node-2", classification, action, node_actions)
    ], opened
    assert all("straggler_cause" in s["attributes"] for s in events_of(database, "straggler"))
    # Every rank's step timings, and both ranks' requested profiles, came in over HTTP.
    checks = {(e["rank"], e["attributes"].get("check")) for e in timings}
    assert {(r, "step_timings") for r in range(3)} <= checks
    assert {(SUSPECT, "profile"), (0, "profile")} <= checks
    assert "refused events" not in (tmp_path / "torchrun.log").read_text()


def test_a_job_hung_in_one_collective_is_named_by_serve_from_the_stalls_its_hooks_post(
    tmp_path: Path,
) -> None:
    """Every rank stops inside step 12's first collective: the stall watch's reports, posted over HTTP
    from the hooks' own thread while the training thread is stuck, name the hang on each node before
    any watchdog (docs/decisions/0021)."""
    database, port = tmp_path / "medic.db", free_port()
    env = {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": "", "MEDIC_BACKENDS": "sim"}
    command = [
        *[arg for arg in job_command(tmp_path, 4) if not arg.startswith("--events=")],
        f"--events=http://127.0.0.1:{port}/v1/events",
        "--steps=40",
        "--ckpt-every=1000",
        "--timings-every=5",
        "--node-of-rank=gpu-node-1,gpu-node-1,gpu-node-2,gpu-node-2",
        "--step-work-s=0.03",
        "--hang-all-at-step=12",
        "--stall-dump-s=1",
    ]
    with server_process(database, port, env), running(tmp_path, command) as job:
        began, named = time.monotonic(), []
        while len(named) < 2:
            assert time.monotonic() - began < GIVE_UP_S and job.poll() is None, "no hang named"
            time.sleep(0.5)
            named = [
                e for e in events_of(database, "nccl_timeout") if e["attributes"].get("detector") == "hang"
            ]
    assert sorted((e["node"], e["attributes"]["evidence"]) for e in named) == [
        ("gpu-node-1", "together"),
        ("gpu-node-2", "together"),
    ]
    assert all(e["attributes"]["before_timeout"] for e in named)
