"""Fault to training again, on the reference job: torchrun's restart in place against a fresh launch.

`PYTHONPATH=tests python -m bench.resume` prints a markdown section. medic/training/train.py runs on the CPU
under a real torchrun, 2 ranks, a checkpoint every 10 steps. Once step 12 is logged it is killed
(SIGKILL) in one of two ways, each repeated:

- restart in place: one worker dies, and torchrun `--max-restarts 1` stops the other and starts
  the group again within the same launch; the path for a fault that leaves the node good.
- fresh launch: the whole launch dies and a new torchrun starts at once; the requeue path (the
  node must go), without the scheduler's part, which is Slurm's and the new node's.

The phases come from the wall-clock timeline the job prints on its first step after a resume
(train.py), and from watching the launch's processes every 10 ms.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from bench.report import Stats, ms, num, table
from medic.integrations.processes import descendants, free_port, kill, running, start_time
from medic.shipped import TRAIN_SCRIPT

RANKS = 2
STEPS = 20
CKPT_EVERY = 10
KILL_AT_STEP = 12  # the checkpoint of step 10 is complete once step 11 is logged
STEP_WORK_S = 0.05  # slow enough that the kill lands between checkpoints
REPEATS = 3
IMPORT_RUNS = 10
LAUNCH_TIMEOUT_S = 180
POLL_S = 0.01
TIMELINE = re.compile(r"rank 0: resume timeline (\{.*\})")
PHASES = ("imports", "process group", "model + checkpoint load", "first step")


@dataclass(frozen=True, slots=True)
class Launch:
    process: subprocess.Popen[str]
    log: Path
    output: IO[str]
    loss_log: Path

    def workers(self) -> dict[int, int]:
        """The training processes (pid -> start time) torchrun started."""
        # One file of torchrun's own, not a scan of /proc: the watch must not slow what it times.
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        try:
            pids = [int(pid) for pid in children.read_text().split()]
        except OSError:
            return {}  # torchrun has exited
        found = {}
        for pid in pids:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # exited while we looked
            started = start_time(pid)
            if TRAIN_SCRIPT.name.encode() in command and started is not None:
                found[pid] = started
        return found

    def finish(self) -> str:
        self.process.wait(LAUNCH_TIMEOUT_S)
        self.output.close()
        text = self.log.read_text()
        if self.process.returncode != 0:
            raise RuntimeError(f"torchrun exited {self.process.returncode}:\n{text[-3000:]}")
        return text

    def kill_all(self) -> None:
        for pid in [*descendants(self.process.pid), self.process.pid]:
            kill(pid)
        self.process.wait()
        self.output.close()


def job_command(workdir: Path, ranks: int, *torchrun_args: str) -> list[str]:
    """The reference job under torchrun on this machine, its checkpoints, losses and events in `workdir`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        *torchrun_args,
        str(TRAIN_SCRIPT),
        f"--ckpt-dir={workdir / 'checkpoints'}",
        f"--loss-log={workdir / 'losses.jsonl'}",
        f"--events={workdir / 'events.jsonl'}",
    ]


def launch(workdir: Path, name: str, *torchrun_args: str) -> Launch:
    log = workdir / f"{name}.log"
    output = log.open("w")
    command = [
        *job_command(workdir, RANKS, *torchrun_args),
        f"--steps={STEPS}",
        f"--ckpt-every={CKPT_EVERY}",
        f"--step-work-s={STEP_WORK_S}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_DEVICE": "cpu"}
    process = subprocess.Popen(
        command, cwd=workdir, env=env, stdout=output, stderr=subprocess.STDOUT, text=True
    )
    return Launch(process, log, output, workdir / "losses.jsonl")


def wait_for_step(run: Launch, step: int) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline:
        if run.process.poll() is not None:
            raise RuntimeError(f"torchrun exited {run.process.returncode} before step {step}")
        if run.loss_log.exists() and any(
            json.loads(line)["step"] >= step for line in run.loss_log.read_text().splitlines()
        ):
            return
        time.sleep(POLL_S)
    raise TimeoutError(f"no step {step} in {LAUNCH_TIMEOUT_S} s")


def watch_restart(run: Launch, old: dict[int, int]) -> tuple[float, float]:
    """When the last of the `old` workers was gone, and when a new worker was first seen."""
    gone = None
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline and run.process.poll() is None:
        now = time.time()
        if gone is None and not any(running(pid, started) for pid, started in old.items()):
            gone = now
        if set(run.workers()) - set(old):
            return gone or now, now
        time.sleep(POLL_S)
    raise RuntimeError("no new workers were started")


def timeline(output: str) -> dict[str, float]:
    found = TIMELINE.findall(output)
    if len(found) != 1:
        raise RuntimeError(f"expected one resume timeline, found {len(found)}:\n{output[-3000:]}")
    return json.loads(found[0])


def phases(marks: dict[str, float]) -> dict[str, float]:
    return {
        "imports": marks["imported"] - marks["started"],
        "process group": marks["joined"] - marks["imported"],
        "model + checkpoint load": marks["loaded"] - marks["joined"],
        "first step": marks["first_step"] - marks["loaded"],
    }


def restart_in_place(workdir: Path) -> dict[str, float]:
    run = launch(workdir, "in-place", "--max-restarts=1")
    try:
        wait_for_step(run, KILL_AT_STEP)
        old = run.workers()
        victim = max(old)
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        stopped, spawned = watch_restart(run, old)
        marks = timeline(run.finish())
    except BaseException:
        run.kill_all()
        raise
    return {
        "detect, decide, stop the group": stopped - killed,
        "start the new group": spawned - stopped,
        "Python's start": marks["started"] - spawned,
        **phases(marks),
        "total": marks["first_step"] - killed,
    }


def fresh_launch(workdir: Path) -> dict[str, float]:
    first = launch(workdir, "first")
    try:
        wait_for_step(first, KILL_AT_STEP)
    finally:
        killed = time.time()
        first.kill_all()
    run = launch(workdir, "requeued")
    launched = time.time()
    try:
        _, spawned = watch_restart(run, {})
        marks = timeline(run.finish())
    except BaseException:
        run.kill_all()
        raise
    return {
        "kill the launch, start a new one": launched - killed,
        "torchrun's start, its rendezvous, the spawn": spawned - launched,
        "Python's start": marks["started"] - spawned,
        **phases(marks),
        "total": marks["first_step"] - killed,
    }


def import_seconds(module: str) -> Stats:
    """In a fresh interpreter each run, from medic/training as a job imports it."""
    code = f"import time; began = time.perf_counter(); import {module}; print(time.perf_counter() - began)"
    samples = []
    for _ in range(IMPORT_RUNS):
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=TRAIN_SCRIPT.parent, capture_output=True, text=True, check=True
        )
        samples.append(float(done.stdout))
    return Stats.of(samples)


def run() -> dict[str, Any]:
    results: dict[str, Any] = {
        "imports": {
            module: import_seconds(module) for module in ("medic_hooks", "checkpoint_layout", "torch")
        }
    }
    for name, path in (("in place", restart_in_place), ("fresh", fresh_launch)):
        samples: dict[str, list[float]] = {}
        for _ in range(REPEATS):
            with tempfile.TemporaryDirectory(prefix="medic-bench-resume-") as tmp:
                for phase, seconds in path(Path(tmp)).items():
                    samples.setdefault(phase, []).append(seconds)
        results[name] = {phase: Stats.of(values) for phase, values in samples.items()}
    return results


def _seconds(stats: Stats) -> str:
    return f"{num(stats.median)} s ({num(stats.low)} to {num(stats.high)})"


def section(results: dict[str, Any]) -> str:
    in_place, fresh = results["in place"], results["fresh"]
    rows: list[tuple[str, str, str]] = [
        (
            "GPU Medic: detect, decide, act",
            "nothing to do: torchrun restarts on its own",
            "see the live path",
        ),
        (
            "torchrun: detect the dead worker, stop the group",
            _seconds(in_place["detect, decide, stop the group"]),
            "",
        ),
        (
            "requeue: the launch killed, a new one started",
            "",
            _seconds(fresh["kill the launch, start a new one"]) + "; Slurm's requeue on top",
        ),
        (
            "relaunch: torchrun starts the workers",
            _seconds(in_place["start the new group"]),
            _seconds(fresh["torchrun's start, its rendezvous, the spawn"]),
        ),
        ("relaunch: Python's start", _seconds(in_place["Python's start"]), _seconds(fresh["Python's start"])),
    ]
    rows += [(f"{phase} (train.py)", _seconds(in_place[phase]), _seconds(fresh[phase])) for phase in PHASES]
    rows.append(("**kill → first step done**", _seconds(in_place["total"]), _seconds(fresh["total"])))
    imports = results["imports"]
    import_rows = [
        (f"`import {module}`", ms(stats.median), ms(stats.p95)) for module, stats in imports.items()
    ]
    return "\n".join(
        [
            "## Fault to training again: restart in place against requeue",
            "",
            f"The reference job (medic/training/train.py) on the CPU under a real torchrun, {RANKS} ranks,",
            f"a checkpoint every {CKPT_EVERY} steps, SIGKILL once step {KILL_AT_STEP} is logged, so each resume loads",
            f"step {CKPT_EVERY}'s checkpoint (tests/bench/resume.py; median of {REPEATS}, low to high). Restart in place:",
            "one worker dies and torchrun `--max-restarts 1` stops the other and starts the group again",
            "inside the same launch, the path for a node that is still good. Requeue: the whole launch dies",
            "and a fresh torchrun starts at once; on a cluster, GPU Medic's detect, decide and act (the live",
            "path above) and Slurm's requeue and scheduling come before it. The phases in train.py come from",
            "the wall-clock timeline it prints on its first step after a resume; the first step includes its",
            f"{STEP_WORK_S * 1000:g} ms of simulated work. Each phase's median is taken on its own, so they need not",
            "add up to the total's.",
            "",
            table(["phase", "restart in place", "fresh launch (requeue)"], rows),
            "",
            f"What a training process imports, each in a fresh interpreter ({IMPORT_RUNS} runs): the hooks and the",
            "checkpoint layout need the standard library only (tests/training/test_training_imports.py), so torch's",
            "import is the whole of a worker's import time.",
            "",
            table(["import", "median", "p95"], import_rows),
        ]
    )


if __name__ == "__main__":
    print(section(run()))
