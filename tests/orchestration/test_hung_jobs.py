"""A job named hung before its watchdog, on nodes that stay in service, is restarted there once
(medic/tasks/resume.py `restart_hung_job`): every rank waiting inside the same collective opens an
incident on each of its nodes, and the first to claim the restart requeues the job. Real Prefect (test
harness), the simulated fleet, the events made by the differential from the ranks' stall reports
(tests/hang_support.py); on real Slurm in tests/orchestration/test_job_off_node.py."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from checkout import REPO_ROOT
from hang_support import hung_job

from medic.events import FaultEvent
from medic.flows.dispatch import Dispatch, remediate_all
from medic.intake import read_lines
from medic.integrations.sim.fleet import SimFleet
from medic.store import Store
from medic.tasks.resume import RESTART
from medic.tasks.runtime.process import Runtime

pytestmark = pytest.mark.usefixtures("prefect_harness")

NODES = ["gpu-node-1", "gpu-node-2"]
START = 1_234


@pytest.fixture
def store(sqlite_store: Store) -> Store:
    return sqlite_store  # the claim's safety across processes is the store's own test: one kind here


def run(rt: Runtime, events: list[FaultEvent]) -> Dispatch:
    lines = [e.model_dump_json() for e in events]
    dispatch = asyncio.run(remediate_all(rt, read_lines(lines, "hang.jsonl")))
    assert not dispatch.failed, dispatch.failed
    return dispatch


def test_a_job_hung_in_one_collective_is_restarted_on_its_nodes_once(
    runtime: Runtime, fleet: SimFleet
) -> None:
    fleet.add_job("llm", "alice", NODES, step=START, checkpoint_every=100)

    dispatch = run(runtime, hung_job("llm", NODES, START))

    assert len(dispatch.outcomes) == 2  # an incident on each node of the job
    assert [call for call in fleet.calls if call[0] == "llm"] == [("llm", "requeue")]
    job = fleet.jobs["llm"]
    assert job.restarts == 1 and sorted(job.nodes) == NODES  # where it was: its nodes stay in service
    restarts = [
        a
        for o in dispatch.outcomes
        for a in runtime.store.incident_detail(o.incident).actions
        if a.action == RESTART
    ]
    assert [(a.status, a.node in NODES) for a in restarts] == [("succeeded", True)]
    resumed = [o.resumed for o in dispatch.outcomes if o.resumed is not None]
    assert len(resumed) == 1 and resumed[0].checkpoint_step == 1_200 and resumed[0].resumed_step > 1_200
    # The other incident says who restarted the job rather than doing it again.
    steps = [
        (s.status, s.summary)
        for o in dispatch.outcomes
        for s in runtime.store.steps_of(o.incident)
        if s.stage == "restart hung job"
    ]
    assert sorted(status for status, _ in steps) == ["ok", "skipped"], steps
    assert any("restarted for this hang by incident" in summary for _, summary in steps), steps


def test_a_hung_job_in_an_observed_group_is_left_to_people(
    runtime: Runtime, fleet: SimFleet, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    shutil.copy(REPO_ROOT / "policies" / "default.yaml", policy)
    watch = '\ngroups:\n  - name: watch\n    select: {hostlist: ["gpu-node-[1-2]"]}\n    mode: observe\n'
    policy.write_text(policy.read_text() + watch)
    runtime.policy_path = policy
    fleet.add_job("llm", "alice", NODES, step=START, checkpoint_every=100)

    dispatch = run(runtime, hung_job("llm", NODES, START))

    assert {o.act for o in dispatch.outcomes} == {"observed"}
    assert fleet.calls == [] and fleet.jobs["llm"].restarts == 0
