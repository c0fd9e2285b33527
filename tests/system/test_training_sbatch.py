"""medic/training/train.sbatch on the real Slurm cluster of tests/system/test_slurm.py: a rank killed
mid-run is restarted in place by torchrun inside the allocation (`--max-restarts`), resumes from its
newest checkpoint bit for bit, and the job finishes without Slurm requeueing it. Two nodes, one rank
each: one torchrun agent per node, as on a real cluster, where only the dead rank's agent counts a
restart (train.py's attempt_store)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from slurm_cluster import Cluster, cluster, slurm  # noqa: F401  (the cluster fixtures, reused)
from torchrun_support import TRAIN_SCRIPT, TRAINING_DIR
from waiting import until

from medic.integrations.processes import kill
from medic.protocols import JobState

pytestmark = pytest.mark.system

SBATCH = TRAINING_DIR / "train.sbatch"
STEPS, EVERY, KILL_AFTER = 24, 10, 12  # killed once step 12 is logged: it resumes from step 10


def rank_pids() -> list[int]:
    """The job's training processes (not torchrun's agent), found by their command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited while we looked
        if str(TRAIN_SCRIPT).encode() in argv and b"torch.distributed.run" not in argv:
            found.append(int(entry.name))
    return found


def kill_a_rank_once_logged(losses: Path, step: int, killed: list[int]) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        logged = (
            [json.loads(line)["step"] for line in losses.read_text().splitlines()] if losses.exists() else []
        )
        if logged and max(logged) >= step and (ranks := rank_pids()):
            kill(max(ranks))
            killed.append(max(ranks))
            return
        time.sleep(0.05)


def test_a_killed_rank_restarts_in_place_and_the_job_finishes_unrequeued(
    slurm: Cluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    tmp_path.chmod(0o755)
    losses, output = tmp_path / "losses.jsonl", tmp_path / "job.out"
    env = {
        "TRAIN_PYTHON": sys.executable,
        "TRAIN_DIR": str(TRAINING_DIR),
        "TRAIN_NPROC_PER_NODE": "1",
        "TRAIN_MAX_RESTARTS": "1",
        "TRAIN_RDZV_PORT": str(29400 + os.getpid() % 500),
        "TRAIN_DEVICE": "cpu",
    }
    killed: list[int] = []
    killer = threading.Thread(target=kill_a_rank_once_logged, args=(losses, KILL_AFTER, killed), daemon=True)
    killer.start()
    job_id = slurm.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        f"--chdir={tmp_path}",
        f"--output={output}",
        f"--export=ALL,{','.join(f'{k}={v}' for k, v in env.items())}",
        str(SBATCH),
        f"--steps={STEPS}",
        f"--ckpt-every={EVERY}",
        f"--ckpt-dir={tmp_path / 'checkpoints'}",
        f"--loss-log={losses}",
        f"--events={tmp_path / 'events.jsonl'}",
        "--step-work-s=0.1",
    )

    def finished() -> object:
        job = next((j for j in slurm.cli.jobs() if j.id == job_id), None)
        return job if job and job.job_state not in (JobState.PENDING, JobState.RUNNING) else None

    job = until(finished, "the job to finish", timeout_s=300)
    killer.join(timeout=5)
    log = output.read_text()
    assert killed, log
    assert job.job_state is JobState.COMPLETED, log
    assert f"rank 0: resumed from step {EVERY}" in log
    assert "Restarts=0" in slurm.run("scontrol", "show", "job", job_id)  # never requeued
    by_step: dict[tuple[int, int], list[str]] = {}
    for line in losses.read_text().splitlines():
        entry = json.loads(line)
        by_step.setdefault((entry["step"], entry["rank"]), []).append(entry["loss"])
    assert sorted(by_step) == [(s, r) for s in range(1, STEPS + 1) for r in (0, 1)]
    again = {key: values for key, values in by_step.items() if len(values) > 1}
    assert again and {key[0] for key in again} <= set(range(EVERY + 1, KILL_AFTER + 2))
    assert all(len(set(values)) == 1 for values in again.values())  # the steps trained again, bit for bit
