"""The reference training job under a real torchrun: crash, then resume from the last checkpoint.

Five launches of ~5 s each on 2 cores: an uninterrupted reference run, a run whose rank 1 dies at
step 25, two resumes of that run's checkpoints (at 2 ranks, and resharded to 1), and a run that
torchrun restarts in place after a rank is killed.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from torchrun_support import LAUNCH_TIMEOUT_S, TRAIN_SCRIPT, TRAINING_DIR, Run, torchrun

from medic.events import EventKind
from medic.integrations.checkpoints import latest_in_directory, parse_step
from medic.integrations.processes import descendants, kill

STEPS, EVERY, FAIL_AT, NAN_AT = 40, 10, 25, 23
LAST_GOOD = 20  # the newest checkpoint before the crash
JOB = "reference-train"  # train.py's default --job
FAULT_EXIT_CODE = 13  # train.py's exit code for an injected fault
SCHEDULE = (f"--steps={STEPS}", f"--ckpt-every={EVERY}")

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = torchrun(tmp_path_factory.mktemp("reference"), 2, *SCHEDULE)
    assert run.returncode == 0, run.output
    return run


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Run:
    faults = (f"--fail-at-step={FAIL_AT}", "--fail-rank=1", f"--nan-at-step={NAN_AT}")
    return torchrun(tmp_path_factory.mktemp("crashed"), 2, *SCHEDULE, *faults)


def resume(crashed: Run, workdir: Path, ranks: int) -> Run:
    """Resume from a copy of the crashed run's checkpoints, as a fresh torchrun."""
    ckpt_dir = workdir / "checkpoints"
    shutil.copytree(crashed.ckpt_dir, ckpt_dir)
    run = torchrun(workdir, ranks, *SCHEDULE, ckpt_dir=ckpt_dir)
    assert run.returncode == 0, run.output
    return run


def test_the_reference_run_saves_every_k_steps(reference: Run) -> None:
    saved = sorted(parse_step(p.name) or 0 for p in reference.ckpt_dir.iterdir())
    assert saved == [10, 20, 30, 40]
    assert set(reference.losses()) == {(step, rank) for step in range(1, STEPS + 1) for rank in (0, 1)}
    assert reference.fault_events() == []  # no NaN, no crash; tiny steps are below the straggler floor


def test_a_rank_dying_fails_the_job_and_is_reported(reference: Run, crashed: Run) -> None:
    assert crashed.returncode != 0
    assert "exitcode  : 13" in crashed.output  # torchrun names the rank that died first
    latest = latest_in_directory(JOB, crashed.ckpt_dir)
    assert latest is not None and latest.step == LAST_GOOD

    losses, expected = crashed.losses(), reference.losses()
    assert max(step for step, _ in losses) == FAIL_AT - 1
    assert all(losses[key] == expected[key] for key in losses if key[0] < NAN_AT)
    assert losses[(NAN_AT, 1)] == "nan"

    events = {(e.kind, e.rank): e for e in crashed.fault_events()}
    nan = events[(EventKind.NAN_LOSS, 1)]
    assert (nan.iteration, nan.job) == (NAN_AT, JOB)
    crash = events[(EventKind.JOB_CRASH, 1)]
    assert crash.attributes["exit_code"] == FAULT_EXIT_CODE
    assert crash.iteration == FAIL_AT - 1  # the last step it finished


def test_resume_repeats_the_reference_bit_for_bit(reference: Run, crashed: Run, tmp_path: Path) -> None:
    run = resume(crashed, tmp_path, ranks=2)
    assert f"resumed from step {LAST_GOOD}" in run.output
    losses, expected = run.losses(), reference.losses()
    assert set(losses) == {(step, rank) for step in range(LAST_GOOD + 1, STEPS + 1) for rank in (0, 1)}
    assert {key: expected[key] for key in losses} == losses
    assert latest_in_directory(JOB, run.ckpt_dir).step == STEPS  # type: ignore[union-attr]


def test_resume_at_one_rank_reshards_the_checkpoint(reference: Run, crashed: Run, tmp_path: Path) -> None:
    run = resume(crashed, tmp_path, ranks=1)
    assert f"resumed from step {LAST_GOOD}" in run.output
    losses, expected = run.losses(), reference.losses()
    assert set(losses) == {(step, 0) for step in range(LAST_GOOD + 1, STEPS + 1)}
    for (step, _), value in losses.items():
        # One rank sees the whole batch; its loss is the mean of the two half-batch losses.
        two_ranks = (float.fromhex(expected[(step, 0)]) + float.fromhex(expected[(step, 1)])) / 2
        assert float.fromhex(value) == pytest.approx(two_ranks, abs=1e-6), step


def kill_a_rank_at(loss_log: Path, step: int) -> None:
    """SIGKILL one rank of the torchrun this test runs once `step` is logged: a process lost, the node good."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline:
        if loss_log.exists() and any(
            json.loads(line)["step"] >= step for line in loss_log.read_text().splitlines()
        ):
            ranks = [pid for pid in descendants(os.getpid()) if rank_process(pid)]
            kill(max(ranks))
            return
        time.sleep(0.05)


def rank_process(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False  # exited while we looked
    return str(TRAIN_SCRIPT).encode() in argv and b"torch.distributed.run" not in argv


def test_torchrun_restarts_the_group_in_place_and_it_resumes_bit_for_bit(
    reference: Run, tmp_path: Path
) -> None:
    # Slowed steps (a sleep, the losses unchanged), so the kill lands after step 20's checkpoint.
    killer = threading.Thread(target=kill_a_rank_at, args=(tmp_path / "losses.jsonl", LAST_GOOD + 2))
    killer.start()
    run = torchrun(tmp_path, 2, *SCHEDULE, "--step-work-s=0.05", launcher_args=("--max-restarts=1",))
    killer.join()
    assert run.returncode == 0, run.output
    assert f"rank 0: resumed from step {LAST_GOOD}" in run.output
    assert run.losses() == reference.losses()  # the restarted attempt's lines come last and win


@pytest.mark.parametrize(
    ("wanted", "local_rank", "local_world", "gpus", "expected"),
    [
        ("auto", 1, 2, 2, "cuda:1"),  # a GPU per rank
        ("auto", 1, 2, 1, "cpu"),  # more ranks than GPUs: every rank on the CPU, none past the last GPU
        ("auto", 0, 1, 0, "cpu"),
        ("cpu", 0, 1, 8, "cpu"),  # forced, as the suite forces it
        ("cuda", 3, 4, 8, "cuda:3"),
    ],
)
def test_each_rank_gets_a_gpu_of_its_own_or_the_cpu(
    wanted: str, local_rank: int, local_world: int, gpus: int, expected: str
) -> None:
    assert str(train_module().pick_device(wanted, local_rank, local_world, gpus)) == expected


def test_cuda_asked_for_without_a_gpu_per_rank_stops_with_the_reason() -> None:
    with pytest.raises(SystemExit, match="needs 2 GPUs on this node \\(one per rank\\); 1 visible"):
        train_module().pick_device("cuda", 1, 2, 1)


def train_module() -> ModuleType:
    sys.path.insert(0, str(TRAINING_DIR))
    try:
        return importlib.import_module("train")
    finally:
        sys.path.remove(str(TRAINING_DIR))
