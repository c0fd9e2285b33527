"""A `Scheduler` whose jobs are real local torchrun launches of the reference training job.

Nodes stay simulated (drains, resumes and states go to `SimScheduler` over the shared fleet),
but a job is a real `torchrun` of medic/training/train.py with one local rank per node it
was given: rank i "runs on" nodes[i]. A requeue kills what is left of the launch and starts a
new one on the healthy nodes, topped up with idle spares or else fewer (DCP reshards on load);
train.py resumes by itself from its newest complete checkpoint. This lets the remediation flow
restart a job that really trains, and lets a test check the losses after the resume.

Layout under `workdir`: checkpoints in `checkpoints/JOB/step-XXXXXXXX/` (so
`DcpCheckpointStore(root=scheduler.checkpoint_root)` reads them) and the loss log, fault events
and one torchrun log per launch in `jobs/JOB/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medic.integrations.checkpoints import latest_in_directory
from medic.integrations.processes import descendants, free_port, kill, start_time, wait_gone
from medic.integrations.sim.fleet import SimFleet, SimJob
from medic.integrations.sim.scheduler import SimScheduler
from medic.protocols import JobInfo, JobState, NodeInfo, NodeState
from medic.shipped import TRAIN_SCRIPT

STOP_TIMEOUT_S = 30.0
# train.py's fault injections fire once: a relaunch leaves them out. True: the option takes a value.
ONE_SHOT_OPTIONS = {
    "--fail-at-step": True,
    "--fail-during-save": False,
    "--nan-at-step": True,
    "--fail-rank": True,
}


def without_one_shot(args: Sequence[str]) -> list[str]:
    """`args` less the fault-injection options, in `--opt=v` or `--opt v` form."""
    kept: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
            continue
        name, equals, _ = arg.partition("=")
        if name in ONE_SHOT_OPTIONS:
            skip_value = ONE_SHOT_OPTIONS[name] and not equals
            continue
        kept.append(arg)
    return kept


def complete_lines(path: Path, offset: int) -> bytes:
    """The file's whole lines from `offset` on; a line still being written is left for later."""
    if not path.exists():
        return b""
    with path.open("rb") as file:
        file.seek(offset)
        data = file.read()
    return data[: data.rfind(b"\n") + 1]


@dataclass(slots=True)
class Launch:
    """One torchrun of a job. Only the loss-log lines after `log_offset` are this launch's."""

    process: subprocess.Popen[bytes]
    nodes: tuple[str, ...]
    loss_log: Path
    log_offset: int
    start_step: int  # the checkpoint it resumes from; 0 for a fresh start
    workers: dict[int, int] = field(default_factory=dict)  # pid -> start time, which tells pids reused
    _read_to: int = 0
    _step: int = 0

    def __post_init__(self) -> None:
        self._read_to, self._step = self.log_offset, self.start_step

    def state(self) -> JobState:
        code = self.process.poll()
        if code is None:
            return JobState.RUNNING
        return JobState.COMPLETED if code == 0 else JobState.FAILED

    def track_workers(self) -> None:
        # Remembered while torchrun lives: once it dies its workers are orphans /proc cannot tie to it.
        if self.process.poll() is None:
            for pid in descendants(self.process.pid):
                started = start_time(pid)
                if started is not None:  # None: it exited while we looked
                    self.workers.setdefault(pid, started)

    def lines(self) -> list[dict[str, Any]]:
        """This launch's complete loss-log lines."""
        return [json.loads(line) for line in complete_lines(self.loss_log, self.log_offset).splitlines()]

    def step(self) -> int:
        """The highest step this launch has logged, or the checkpoint step it started from."""
        new = complete_lines(self.loss_log, self._read_to)
        self._read_to += len(new)
        for line in new.splitlines():
            self._step = max(self._step, int(json.loads(line)["step"]))
        return self._step

    def stop(self) -> None:
        """Kill torchrun's process group and its workers, which live in sessions of their own."""
        self.track_workers()
        if self.process.poll() is None:  # once reaped, its pid (and group id) may be someone else's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        for pid, started in self.workers.items():
            kill(pid, started)
        self.process.wait()
        # A relaunch must not overlap them: they could still append to the loss log or a checkpoint.
        left = wait_gone(self.workers, STOP_TIMEOUT_S)
        if left:
            raise RuntimeError(f"workers {left} of torchrun {self.process.pid} survived SIGKILL")


@dataclass(slots=True)
class LocalJob:
    id: str
    owner: str
    train_args: list[str]
    launches: list[Launch] = field(default_factory=list)

    @property
    def current(self) -> Launch:
        return self.launches[-1]


class LocalTorchrunScheduler:
    """Simulated nodes, real local torchrun jobs. Call `close()` to kill every launch still running."""

    def __init__(self, fleet: SimFleet, workdir: Path, script: Path = TRAIN_SCRIPT) -> None:
        self.fleet = fleet
        self.nodes_backend = SimScheduler(fleet)
        self.workdir = workdir
        self.checkpoint_root = workdir / "checkpoints"
        self.script = script
        self.jobs: dict[str, LocalJob] = {}

    def job_dir(self, job_id: str) -> Path:
        return self.workdir / "jobs" / job_id

    def ckpt_dir(self, job_id: str) -> Path:
        return self.checkpoint_root / job_id

    def loss_log(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "loss.jsonl"

    # Nodes: the simulated fleet's, with Slurm's semantics.

    def nodes(self) -> list[NodeInfo]:
        self._sync()
        return self.nodes_backend.nodes()

    def node(self, name: str) -> NodeInfo:
        self._sync()
        return self.nodes_backend.node(name)

    def drain(self, name: str, reason: str) -> None:
        self.nodes_backend.drain(name, reason)

    def resume(self, name: str) -> None:
        self._sync()  # it decides between idle and allocated from the jobs' states
        self.nodes_backend.resume(name)

    # Jobs: real launches.

    def submit(self, job_id: str, owner: str, nodes: list[str], train_args: list[str]) -> JobInfo:
        if not nodes:
            raise ValueError(f"job {job_id} needs at least one node")
        with self.fleet.lock:
            if job_id in self.jobs:
                raise ValueError(f"job {job_id} exists")
            job = LocalJob(job_id, owner, list(train_args))
            self.fleet.add_job(job_id, owner, nodes)
            job.launches.append(self._launch(job, tuple(nodes), job.train_args))
            self.jobs[job_id] = job
            return self._info(job)

    def job(self, job_id: str) -> JobInfo | None:
        with self.fleet.lock:
            job = self.jobs.get(job_id)
            if job is None:
                return None
            self._sync()
            return self._info(job)

    def jobs_on_node(self, name: str) -> list[JobInfo]:
        with self.fleet.lock:
            self._sync()
            return [self._info(job) for job in self.jobs.values() if name in job.current.nodes]

    def readmit(self, job_id: str, node: str) -> bool:
        return False  # its requeue relaunches at once, on fewer nodes if it must: it never waits

    def requeue(self, job_id: str, exclude: list[str]) -> JobInfo:
        """Relaunch the job away from `exclude`, on spare idle nodes if any, else on fewer nodes."""
        with self.fleet.lock:
            self.fleet.record_call(job_id, "requeue")
            job = self.jobs[job_id]
            job.current.stop()
            self._sync()  # its nodes are free now, as Slurm frees a dead job's nodes
            old = job.current.nodes
            keep = [n for n in old if n not in exclude]
            spare = [
                n.name
                for n in self.fleet.nodes.values()
                if n.state is NodeState.IDLE and n.name not in exclude and n.name not in keep
            ]
            nodes = tuple(keep + spare[: len(old) - len(keep)])
            if not nodes:
                raise RuntimeError(f"job {job_id}: no healthy node left to run on")
            job.launches.append(self._launch(job, nodes, without_one_shot(job.train_args)))
            self._sync()
            return self._info(job)

    def losses(self, job_id: str, launch: int = -1) -> dict[tuple[int, int], str]:
        """(step, rank) -> loss as float.hex() for one launch of the job (default: the latest)."""
        with self.fleet.lock:
            lines = self.jobs[job_id].launches[launch].lines()
        return {(line["step"], line["rank"]): line["loss"] for line in lines}

    def close(self) -> None:
        with self.fleet.lock:
            for job in self.jobs.values():
                job.current.stop()
            self._sync()

    def _launch(self, job: LocalJob, nodes: tuple[str, ...], train_args: list[str]) -> Launch:
        folder = self.job_dir(job.id)
        folder.mkdir(parents=True, exist_ok=True)
        ckpt_dir, loss_log = self.ckpt_dir(job.id), self.loss_log(job.id)
        checkpoint = latest_in_directory(job.id, ckpt_dir)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={len(nodes)}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(self.script),
            f"--job={job.id}",
            f"--ckpt-dir={ckpt_dir}",
            f"--loss-log={loss_log}",
            f"--events={folder / 'events.jsonl'}",
            *train_args,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        offset = loss_log.stat().st_size if loss_log.exists() else 0
        with (folder / f"torchrun-{len(job.launches)}.log").open("wb") as output:
            process = subprocess.Popen(
                command, cwd=folder, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        return Launch(
            process=process,
            nodes=nodes,
            loss_log=loss_log,
            log_offset=offset,
            start_step=checkpoint.step if checkpoint else 0,
        )

    def _sync(self) -> None:
        """Carry the launches' states into the fleet: its jobs, and which of their nodes are allocated."""
        with self.fleet.lock:
            used: set[str] = set()
            for job in self.jobs.values():
                launch = job.current
                launch.track_workers()
                sim: SimJob = self.fleet.jobs[job.id]
                sim.state, sim.step, sim.nodes = launch.state(), launch.step(), list(launch.nodes)
                sim.restarts = len(job.launches) - 1
                used.update(n for past in job.launches for n in past.nodes)
            busy = {n for sim in self.fleet.jobs.values() if sim.state is JobState.RUNNING for n in sim.nodes}
            for name in used:
                node = self.fleet.nodes[name]
                if name in busy and node.state is NodeState.IDLE:
                    node.state = NodeState.ALLOCATED
                elif name not in busy and node.state is NodeState.ALLOCATED:
                    node.state = NodeState.IDLE

    def _info(self, job: LocalJob) -> JobInfo:
        launch = job.current
        return JobInfo(job.id, launch.state(), launch.nodes, job.owner, launch.step(), len(job.launches) - 1)
