"""End to end: a real torchrun job loses a rank to a GPU fault, the flow remediates the node and
the job resumes from its DCP checkpoint on the nodes left, repeating the reference losses.

Nodes are simulated; the job is real (LocalTorchrunScheduler). One reference launch and two
crash-and-resume pairs, ~5 s each on 2 cores.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from checkout import REPO_ROOT
from local_jobs import LocalTorchrunScheduler
from torchrun_support import Run, torchrun

from medic.events import FaultEvent
from medic.flows.dispatch import Dispatch, remediate_all
from medic.intake import read_lines
from medic.integrations import registry
from medic.integrations.checkpoints import DcpCheckpointStore
from medic.integrations.sim.fleet import SimFleet
from medic.protocols import JobInfo, JobState, NodeState
from medic.store import Store
from medic.tasks.runtime.process import Runtime, configure

# A resume that never shows progress would hold the flow for its 900 s wait: fail well before.
pytestmark = [pytest.mark.system, pytest.mark.usefixtures("prefect_harness"), pytest.mark.timeout(180)]

JOB, OWNER = "llm", "alice"
STEPS, EVERY, FAIL_AT, LAST_GOOD = 40, 10, 25, 20
SCHEDULE = [f"--steps={STEPS}", f"--ckpt-every={EVERY}"]
FAULT = [f"--fail-at-step={FAIL_AT}", "--fail-rank=1"]  # rank 1 runs on the job's second node
NODES = ["gpu-node-1", "gpu-node-2"]
WAIT_S = 120  # a launch takes 5-7 s on 2 cores; the rest is headroom for a loaded machine


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], str]:
    run: Run = torchrun(tmp_path_factory.mktemp("reference"), 2, *SCHEDULE)
    assert run.returncode == 0, run.output
    return run.losses()


def crashed_job(
    fleet_size: int, tmp_path: Path, store: Store
) -> Iterator[tuple[Runtime, LocalTorchrunScheduler]]:
    """The job submitted on two nodes of a fleet of `fleet_size`, after its rank 1 has died."""
    fleet = SimFleet.build(nodes=fleet_size)
    scheduler = LocalTorchrunScheduler(fleet, tmp_path)
    backends = registry.simulated(fleet)[0]
    backends.scheduler = scheduler
    backends.checkpoints = DcpCheckpointStore(root=scheduler.checkpoint_root)
    runtime = configure(Runtime(store, backends, REPO_ROOT / "policies" / "default.yaml"))
    try:
        scheduler.submit(JOB, OWNER, NODES, [*SCHEDULE, *FAULT])
        assert {fleet.nodes[n].state for n in NODES} == {NodeState.ALLOCATED}
        failed = wait_for(scheduler, lambda info: info.state is not JobState.RUNNING)
        assert (failed.state, failed.step) == (JobState.FAILED, FAIL_AT - 1)
        yield runtime, scheduler
    finally:
        scheduler.close()


@pytest.fixture
def with_spare(tmp_path: Path, sqlite_store: Store) -> Iterator[tuple[Runtime, LocalTorchrunScheduler]]:
    yield from crashed_job(3, tmp_path, sqlite_store)


@pytest.fixture
def without_spare(tmp_path: Path, sqlite_store: Store) -> Iterator[tuple[Runtime, LocalTorchrunScheduler]]:
    yield from crashed_job(2, tmp_path, sqlite_store)


def wait_for(scheduler: LocalTorchrunScheduler, done: Callable[[JobInfo], bool]) -> JobInfo:
    deadline = time.monotonic() + WAIT_S
    while True:
        info = scheduler.job(JOB)
        assert info is not None
        if done(info):
            return info
        assert time.monotonic() < deadline, f"job {JOB} stuck: {info}"
        time.sleep(0.2)


def xid79(runtime: Runtime, node: str) -> Dispatch:
    event = FaultEvent.model_validate(
        {
            "id": f"xid-{node}",
            "time": datetime.now(UTC).isoformat(),
            "source": "test",
            "kind": "xid",
            "node": node,
            "gpu": 0,
            "job": JOB,
            "attributes": {"code": 79},
        }
    )
    return asyncio.run(remediate_all(runtime, read_lines([event.model_dump_json()], "e2e.jsonl")))


def remediate_and_finish(runtime: Runtime, scheduler: LocalTorchrunScheduler) -> tuple[Dispatch, JobInfo]:
    dispatch = xid79(runtime, NODES[1])
    assert not dispatch.failed, dispatch.failed
    finished = wait_for(scheduler, lambda info: info.state is not JobState.RUNNING)
    assert (finished.state, finished.step, finished.restarts) == (JobState.COMPLETED, STEPS, 1)
    return dispatch, finished


def resume_detail(runtime: Runtime, incident: str) -> dict[str, object]:
    detail = runtime.store.incident_detail(incident)
    assert detail is not None and detail.incident.status == "closed"
    (step,) = [s for s in detail.steps if s.stage == "resume job"]
    assert step.detail is not None
    return step.detail


def test_the_flow_resumes_a_crashed_job_on_a_spare_node_bit_for_bit(
    reference: dict[tuple[int, int], str], with_spare: tuple[Runtime, LocalTorchrunScheduler]
) -> None:
    runtime, scheduler = with_spare
    dispatch, finished = remediate_and_finish(runtime, scheduler)

    (outcome,) = dispatch.outcomes
    assert (outcome.action, outcome.act) == ("reboot", "done")
    assert outcome.resumed is not None
    assert outcome.resumed.checkpoint_step == LAST_GOOD
    assert outcome.resumed.resumed_step is not None and outcome.resumed.resumed_step > LAST_GOOD
    assert outcome.resumed.nodes == ["gpu-node-1", "gpu-node-3"]  # the spare took the bad node's place
    assert outcome.verified is not None and outcome.verified.passed
    assert resume_detail(runtime, outcome.incident)["checkpoint_step"] == LAST_GOOD

    losses = scheduler.losses(JOB)
    assert min(step for step, _ in losses) == LAST_GOOD + 1
    assert set(losses) == {(step, rank) for step in range(LAST_GOOD + 1, STEPS + 1) for rank in (0, 1)}
    assert losses == {key: reference[key] for key in losses}

    fleet = scheduler.fleet
    assert [a for n, a in fleet.calls if n == NODES[1]] == ["drain", "reboot", "diagnose-l1", "resume"]
    assert {n: fleet.nodes[n].state for n in fleet.nodes} == {n: NodeState.IDLE for n in fleet.nodes}
    assert finished.nodes == ("gpu-node-1", "gpu-node-3")


def test_without_a_spare_the_job_resumes_on_one_rank_and_reshards(
    reference: dict[tuple[int, int], str], without_spare: tuple[Runtime, LocalTorchrunScheduler]
) -> None:
    runtime, scheduler = without_spare
    dispatch, finished = remediate_and_finish(runtime, scheduler)

    (outcome,) = dispatch.outcomes
    assert outcome.resumed is not None and outcome.resumed.nodes == ["gpu-node-1"]
    assert resume_detail(runtime, outcome.incident)["checkpoint_step"] == LAST_GOOD
    assert finished.nodes == ("gpu-node-1",)

    losses = scheduler.losses(JOB)
    assert set(losses) == {(step, 0) for step in range(LAST_GOOD + 1, STEPS + 1)}
    for (step, _), value in losses.items():
        # One rank sees the whole batch: its loss is the mean of the two half-batch losses.
        two_ranks = (float.fromhex(reference[(step, 0)]) + float.fromhex(reference[(step, 1)])) / 2
        assert float.fromhex(value) == pytest.approx(two_ranks, abs=1e-6), step
