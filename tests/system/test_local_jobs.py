"""LocalTorchrunScheduler on its own: real torchrun jobs on simulated nodes (one ~5 s launch pair)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_jobs import LocalTorchrunScheduler, without_one_shot

from medic.integrations.processes import running
from medic.integrations.sim.fleet import SimFleet
from medic.protocols import JobState, NodeState

JOB = "long"
WAIT_S = 120  # a launch takes 5-7 s on 2 cores; the rest is headroom for a loaded machine


def test_a_relaunch_leaves_out_the_one_shot_fault_injections() -> None:
    args = [
        "--steps=40",
        "--fail-at-step",
        "25",
        "--fail-rank=1",
        "--fail-during-save",
        "--nan-at-step=3",
        "--seed",
        "7",
    ]
    assert without_one_shot(args) == ["--steps=40", "--seed", "7"]


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[LocalTorchrunScheduler]:
    scheduler = LocalTorchrunScheduler(SimFleet.build(nodes=2), tmp_path)
    yield scheduler
    scheduler.close()


def wait_for_step(scheduler: LocalTorchrunScheduler, above: int) -> int:
    deadline = time.monotonic() + WAIT_S
    while (info := scheduler.job(JOB)) is not None and (info.step or 0) <= above:
        assert info.state is JobState.RUNNING, info
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
    assert info is not None and info.step is not None
    return info.step


@pytest.mark.system
def test_requeue_kills_the_running_launch_and_resumes_on_fewer_nodes(
    scheduler: LocalTorchrunScheduler,
) -> None:
    fleet = scheduler.fleet
    scheduler.submit(JOB, "bob", ["gpu-node-1", "gpu-node-2"], ["--steps=1000000", "--ckpt-every=10"])
    wait_for_step(scheduler, 30)  # past a checkpoint
    assert [j.id for j in scheduler.jobs_on_node("gpu-node-2")] == [JOB]
    assert fleet.nodes["gpu-node-2"].state is NodeState.ALLOCATED
    old = scheduler.jobs[JOB].current
    workers = dict(old.workers)
    assert len(workers) >= 2 and all(running(pid, started) for pid, started in workers.items())

    info = scheduler.requeue(JOB, exclude=["gpu-node-2"])

    assert old.process.returncode is not None
    assert not any(running(pid, started) for pid, started in workers.items())
    assert (info.state, info.nodes, info.restarts) == (JobState.RUNNING, ("gpu-node-1",), 1)
    resumed_from = info.step
    assert resumed_from is not None and resumed_from >= 30 and resumed_from % 10 == 0
    assert fleet.nodes["gpu-node-2"].state is NodeState.IDLE  # no longer the job's
    assert scheduler.jobs_on_node("gpu-node-2") == []

    wait_for_step(scheduler, resumed_from)
    first = min(scheduler.losses(JOB))
    assert first == (resumed_from + 1, 0)  # world size 1 now: one rank
    scheduler.close()
    assert scheduler.job(JOB).state is JobState.FAILED  # type: ignore[union-attr]
    assert {n.state for n in fleet.nodes.values()} == {NodeState.IDLE}
