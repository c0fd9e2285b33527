"""The job leaves the node before anything stresses or resets it (docs/decisions/0008-job-off-node.md):
requeued off it before a DCGM level 2-4 run and before a reboot, reset or replacement, once per incident,
recorded as a `requeue` action and a `move job off` step; a job that cannot be moved stops the level or
the action, and the incident escalates with the node held. Real Prefect (test harness), the simulated
fleet, and at the end a real local Slurm cluster: with no RebootProgram, with a GPU reset in place
through nvidia-smi (recorded answers) beside Slurm's reboot, and with a spare held by a reservation.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import slurm_cluster
from checkout import REPO_ROOT
from factories import fault_event
from gpu_reset_support import BUSY, H200, NVSENTINEL_BUS, SUCCEEDED, Node, hopper_node
from hang_support import hung_job
from slurm_cluster import NODES, Cluster, until

from medic.flows.dispatch import Dispatch, remediate_all
from medic.flows.remediate import Outcome
from medic.intake import read_lines
from medic.integrations import registry
from medic.integrations.gpu_reset import GPUS, PROCESSES
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.slurm import SlurmCli, SlurmRebootProvider, SlurmScheduler
from medic.integrations.slurm.errors import SlurmUnreachableError
from medic.integrations.slurm.provider import BOOT_SLACK_S
from medic.protocols import SPARES_RESERVATION, JobState, NodeState
from medic.store import IncidentDetail, Store
from medic.tasks.runtime import process as runtime_module
from medic.tasks.runtime.process import Runtime, configure

pytestmark = pytest.mark.usefixtures("prefect_harness")
# tests/slurm_cluster.py's fixtures: the Slurm tests here get a cluster of their own (module scope).
cluster = slurm_cluster.cluster
slurm = slurm_cluster.slurm

T0 = datetime.now(UTC) - timedelta(minutes=5)
BAD, OTHER = "gpu-node-1", "gpu-node-2"


def line(n: int, kind: str, node: str, seconds: float = 0, **fields: Any) -> str:
    return fault_event(
        kind, id=f"off-{node}-{n}", node=node, at=T0, seconds=seconds, **fields
    ).model_dump_json()


def run(rt: Runtime, lines: list[str]) -> Outcome:
    dispatch: Dispatch = asyncio.run(remediate_all(rt, read_lines(lines, "off.jsonl")))
    assert not dispatch.failed, dispatch.failed
    (outcome,) = dispatch.outcomes
    return outcome


def xid79(node: str = BAD) -> list[str]:
    return [line(1, "xid", node, gpu=0, job="llm", attributes={"code": 79})]


def stragglers(node: str = BAD) -> list[str]:
    return [
        line(i, "straggler", node, i * 10, job="llm", attributes={"step_time_ratio": 1.4}) for i in range(3)
    ]


def detail_of(rt: Runtime, outcome: Outcome) -> IncidentDetail:
    detail = rt.store.incident_detail(outcome.incident)
    assert detail is not None
    return detail


def order(fleet: SimFleet) -> list[tuple[str, str]]:
    """The backend calls about the bad node and the job, in the order they happened."""
    return [(target, call) for target, call in fleet.calls if target in (BAD, "llm")]


@pytest.fixture
def training(fleet: SimFleet) -> Iterator[SimFleet]:
    """A job that still trains on the bad node when the fault comes in."""
    fleet.add_job("llm", "alice", [BAD, OTHER], step=1_234, checkpoint_every=100)
    yield fleet


def assert_escalated_after_a_failed_reboot(rt: Runtime, outcome: Outcome) -> None:
    """The node was drained and its job moved off before the reboot failed; the incident escalated."""
    detail = detail_of(rt, outcome)
    assert detail.incident.status == "escalated"
    assert {a.action: a.status for a in detail.actions} == {
        "drain": "succeeded",
        "requeue": "succeeded",
        "reboot": "failed",
    }


def test_the_job_leaves_before_the_reboot_and_is_requeued_once(runtime: Runtime, training: SimFleet) -> None:
    outcome = run(runtime, xid79())

    assert (outcome.action, outcome.act) == ("reboot", "done")
    assert order(training) == [
        (BAD, "drain"),
        ("llm", "requeue"),
        (BAD, "reboot"),
        (BAD, "diagnose-l1"),
        (BAD, "resume"),
    ]
    # Waited on after the act, not requeued again: resumed from the checkpoint it had when it left.
    assert outcome.resumed is not None
    assert (outcome.resumed.checkpoint_step, BAD in outcome.resumed.nodes) == (1_200, False)
    assert outcome.resumed.resumed_step is not None and outcome.resumed.resumed_step > 1_200
    detail = detail_of(runtime, outcome)
    assert {a.action: a.status for a in detail.actions} == {
        "drain": "succeeded",
        "requeue": "succeeded",
        "reboot": "succeeded",
        "resume": "succeeded",
    }
    stages = [s.stage for s in detail.steps]
    assert stages.index("move job off") < stages.index("act: reboot") < stages.index("resume job")
    (move,) = [s for s in detail.steps if s.stage == "move job off"]
    assert (move.status, move.detail["job"], move.detail["checkpoint_step"]) == ("ok", "llm", 1_200)
    (resume,) = [s for s in detail.steps if s.stage == "resume job"]
    assert resume.detail is not None and resume.detail["checkpoint_step"] == 1_200
    (requeue,) = [a for a in detail.actions if a.action == "requeue"]
    assert requeue.detail == f"job llm requeued off {BAD} from checkpoint step 1200"


def test_a_level_2_run_starts_only_once_the_job_has_left(runtime: Runtime, training: SimFleet) -> None:
    training.script_diagnostic(BAD, 2, "fail", ("DCGM_FR_ROW_REMAP_FAILURE",))
    outcome = run(runtime, stragglers())

    assert (outcome.action, outcome.diagnostics) == ("reset_gpu", ["L2 fail (DCGM_FR_ROW_REMAP_FAILURE)"])
    # Moved before the stress test; the reset finds it gone and does not move it again.
    assert order(training)[:4] == [
        (BAD, "drain"),
        ("llm", "requeue"),
        (BAD, "diagnose-l2"),
        (BAD, "reset_gpu"),
    ]
    assert training.calls.count(("llm", "requeue")) == 1
    assert outcome.resumed is not None and outcome.resumed.checkpoint_step == 1_200
    assert BAD not in training.jobs["llm"].nodes


def test_a_job_moved_for_a_passing_level_2_run_is_waited_on(runtime: Runtime, training: SimFleet) -> None:
    outcome = run(runtime, stragglers())

    assert (outcome.action, outcome.diagnostics) == ("reintegrate", ["L2 pass"])
    assert training.calls.count(("llm", "requeue")) == 1
    # Reintegration takes no node out, yet the job this incident moved is followed to its resume.
    assert outcome.resumed is not None and outcome.resumed.job == "llm"
    assert training.nodes[BAD].state is NodeState.IDLE


def test_a_failed_reboot_leaves_the_job_off_and_the_node_held(runtime: Runtime, training: SimFleet) -> None:
    training.fail_next(BAD, "reboot", times=1, permanent=True)
    outcome = run(runtime, xid79())

    assert outcome.act == "escalated" and "reboot refusal" in outcome.summary
    assert BAD not in training.jobs["llm"].nodes and training.jobs["llm"].state is JobState.RUNNING
    assert training.nodes[BAD].state is NodeState.DRAINED
    assert training.calls.count(("llm", "requeue")) == 1
    assert outcome.resumed is not None and outcome.resumed.checkpoint_step == 1_200
    assert_escalated_after_a_failed_reboot(runtime, outcome)


def test_a_job_that_cannot_be_moved_stops_the_reboot(runtime: Runtime, training: SimFleet) -> None:
    training.fail_next("llm", "requeue", times=1, permanent=True)
    outcome = run(runtime, xid79())

    assert outcome.act == "escalated"
    assert "job llm could not be moved off gpu-node-1" in outcome.summary
    assert "reboot not called, gpu-node-1 held out of service" in outcome.summary
    assert "reboot" not in [call for target, call in training.calls if target == BAD]
    assert BAD in training.jobs["llm"].nodes  # still there: nothing stressed or reset it
    assert training.nodes[BAD].state is NodeState.DRAINED
    detail = detail_of(runtime, outcome)
    assert detail.incident.status == "escalated"
    actions = {a.action: (a.status, a.detail) for a in detail.actions}
    assert actions["requeue"][0] == "failed" and actions["reboot"][0] == "failed"
    assert actions["reboot"][1].startswith("not called: job llm could not be moved off")
    assert [s.status for s in detail.steps if s.stage == "move job off"] == ["failed"]


def test_a_job_that_cannot_be_moved_stops_the_level_2_run(runtime: Runtime, training: SimFleet) -> None:
    training.fail_next("llm", "requeue", times=1, permanent=True)
    outcome = run(runtime, stragglers())

    assert (outcome.action, outcome.act) == ("escalate", "escalated")
    assert outcome.diagnostics == ["L2 not run (a job still on the node)"]
    assert "diagnose not run, node held out of service: job llm could not be moved" in outcome.reason
    assert "diagnose-l2" not in [call for target, call in training.calls if target == BAD]
    assert training.nodes[BAD].state is NodeState.DRAINED
    detail = detail_of(runtime, outcome)
    assert detail.incident.status == "escalated"
    assert detail.decisions[-1].blocked_action == "diagnose" and detail.decisions[-1].guardrail is None
    (step,) = [s for s in detail.steps if s.stage == "diagnose L2"]
    assert step.status == "skipped" and "held out of service" in step.summary


def test_a_requeue_that_failed_transiently_is_tried_again_once(runtime: Runtime, training: SimFleet) -> None:
    training.fail_next("llm", "requeue", times=1)
    outcome = run(runtime, xid79())

    assert (outcome.action, outcome.act) == ("reboot", "done")
    assert training.calls.count(("llm", "requeue")) == 2  # the failed call and its retry, then no more
    assert training.calls.count((BAD, "reboot")) == 1
    (requeue,) = [a for a in detail_of(runtime, outcome).actions if a.action == "requeue"]
    assert (requeue.status, requeue.attempts) == ("succeeded", 2)


# --- a real Slurm cluster ------------------------------------------------------------------------


@pytest.fixture
def slurm_runtime(slurm: Cluster, sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> Runtime:
    """Slurm schedules and reboots; the 4-node simulated fleet stands in for DCGM, chat and checkpoints."""
    backends = registry.simulated(SimFleet.build(nodes=4))[0]
    backends.scheduler = SlurmScheduler()
    backends.provider = SlurmRebootProvider(poll_interval_s=0.2)
    monkeypatch.setattr(runtime_module, "_current", None)  # put back after the test
    return configure(Runtime(sqlite_store, backends, REPO_ROOT / "policies" / "default.yaml"))


@pytest.fixture
def no_reboot_program(slurm: Cluster) -> Iterator[None]:
    conf = slurm.base / "etc" / "slurm.conf"
    written = conf.read_text()
    conf.write_text(written.replace("\nRebootProgram=", "\n#RebootProgram="))
    slurm.run("scontrol", "reconfigure")
    try:
        yield
    finally:
        conf.write_text(written)
        slurm.run("scontrol", "reconfigure")


@pytest.mark.system
@pytest.mark.usefixtures("no_reboot_program")
def test_slurm_without_a_reboot_program_the_job_leaves_and_the_node_stays_held(
    slurm: Cluster, slurm_runtime: Runtime
) -> None:
    job_id = slurm.sbatch("--nodes=2", "--exclusive", "--requeue", user="nobody")
    bad = slurm.running(job_id).nodes[0]
    event = fault_event("xid", id="slurm-off-1", node=bad, gpu=0, job=job_id, at=datetime.now(UTC))
    outcome = run(slurm_runtime, [event.model_dump_json()])

    assert outcome.act == "escalated" and "RebootProgram" in outcome.summary, outcome.summary
    again = slurm.running(job_id)  # restarted elsewhere once its old credential expired
    assert bad not in again.nodes and bad in again.excluded.split(",") and again.restarts == 1
    node = slurm.cli.node(bad)
    assert "DRAIN" in node.flags and node.reason == f"medic: reboot incident {outcome.incident}"
    assert_escalated_after_a_failed_reboot(slurm_runtime, outcome)
    assert outcome.resumed is not None and outcome.resumed.nodes == list(again.nodes)


@pytest.mark.system
def test_slurm_with_no_spare_and_no_idle_node_the_job_starts_again_on_the_repaired_node(
    slurm: Cluster, slurm_runtime: Runtime
) -> None:
    job_id = slurm.sbatch(f"--nodes={len(NODES)}", "--exclusive", "--requeue", user="nobody")  # every node
    bad = slurm.running(job_id).nodes[0]
    event = fault_event("xid", id="slurm-full-1", node=bad, gpu=0, job=job_id, at=datetime.now(UTC))
    outcome = run(slurm_runtime, [event.model_dump_json()])

    assert (outcome.action, outcome.act) == ("reboot", "done"), outcome.summary
    # Barred from the bad node while it was repaired, the job finds no other node; once the node
    # is back, it may start there.
    assert outcome.verified is not None and outcome.verified.passed, outcome.summary
    assert outcome.resumed is not None and outcome.resumed.readmitted == bad, outcome.summary
    assert f"it waited for {bad}, repaired, with no other node free" in outcome.summary
    again = slurm.running(job_id)
    assert bad in again.nodes and again.restarts == 1 and again.excluded == ""
    assert bad in outcome.resumed.nodes
    assert not slurm.cli.node(bad).flags & {"DRAIN"}


@pytest.mark.system
def test_slurm_a_job_hung_in_one_collective_is_requeued_onto_its_own_nodes_once(
    slurm: Cluster, slurm_runtime: Runtime
) -> None:
    job_id = slurm.sbatch("--nodes=2", "--exclusive", "--requeue", user="nobody")
    nodes = list(slurm.running(job_id).nodes)
    events = hung_job(job_id, nodes)
    dispatch = asyncio.run(
        remediate_all(slurm_runtime, read_lines([e.model_dump_json() for e in events], "h"))
    )
    assert not dispatch.failed, dispatch.failed

    resumed = [o.resumed for o in dispatch.outcomes if o.resumed is not None]
    assert len(dispatch.outcomes) == 2 and len(resumed) == 1, [o.summary for o in dispatch.outcomes]
    again = slurm.running(job_id)  # once its old credential expired, on the nodes it had
    assert again.restarts == 1 and sorted(again.nodes) == sorted(nodes) and again.excluded == ""
    assert all(not slurm.cli.node(n).flags & {"DRAIN"} for n in nodes)  # a level-1 pass: in service


class LostReply(SlurmCli):
    """The command reaches slurmctld and takes effect, but the answer never comes back (a timeout)."""

    def __init__(self, lose: set[str]) -> None:
        super().__init__()
        self.lose = lose

    def scontrol(self, *args: str) -> str:
        out = super().scontrol(*args)
        if args[0] in self.lose:
            self.lose.discard(args[0])
            raise SlurmUnreachableError(["scontrol", *args], "no answer within 30 s")
        return out


@pytest.mark.system
@pytest.mark.parametrize("lost", [{"requeuehold"}, {"release"}, {"requeuehold", "release"}])
def test_slurm_a_requeue_whose_answer_is_lost_never_leaves_the_job_held(
    slurm: Cluster, lost: set[str]
) -> None:
    job_id = slurm.sbatch("--nodes=1", "--requeue")
    node = slurm.running(job_id).nodes[0]
    scheduler = SlurmScheduler(LostReply(set(lost)))

    requeued = scheduler.requeue(job_id, [node])

    assert requeued.restarts == 1 and not scheduler._holding
    shown = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "Priority=0" not in shown and f"ExcNodeList={node}" in shown, shown
    assert node not in slurm.running(job_id).nodes


# --- the GPU reset in place, beside Slurm's reboot -----------------------------------------------


def xid48(node: str, event_id: str) -> list[str]:
    """An XID 48 (a double-bit ECC error), which NVIDIA's catalog resolves with a GPU reset."""
    event = fault_event("xid", id=event_id, node=node, gpu=0, at=datetime.now(UTC), attributes={"code": 48})
    return [event.model_dump_json()]


def booted(slurm: Cluster, node: str) -> int:
    """The node's BootTime once slurmd has registered: a node just resumed answers none for a moment."""
    return until(lambda: slurm.cli.node_and_boot(node)[1], f"{node}'s BootTime")


def reboots(slurm: Cluster) -> str:
    log = slurm.base / "log" / "reboots.log"
    return log.read_text() if log.exists() else ""


@pytest.mark.system
def test_slurm_the_gpu_is_reset_in_place_and_the_node_never_rebooted(
    slurm: Cluster, slurm_runtime: Runtime, tmp_path: Path
) -> None:
    gpu_node = Node(tmp_path, names=(BAD,))
    gpu_node.answer(hopper_node((SUCCEEDED, 0)))
    slurm_runtime.backends.gpu_reset = gpu_node.resetter()
    before, rebooted = booted(slurm, BAD), reboots(slurm)

    outcome = run(slurm_runtime, xid48(BAD, "slurm-reset-1"))
    verified = outcome.verified is not None and outcome.verified.passed
    assert (outcome.action, outcome.act, verified) == ("reset_gpu", "done", True), outcome.summary
    assert f"reset GPU 0 ({NVSENTINEL_BUS}) on {BAD} with nvidia-smi in " in outcome.summary
    actions = {a.action: a.status for a in detail_of(slurm_runtime, outcome).actions}
    assert actions == {"drain": "succeeded", "reset_gpu": "succeeded", "resume": "succeeded"}
    assert "--gpu-reset -i 0" in gpu_node.calls()
    # Slurm never rebooted it: the same boot (re-registering may move it a second), no reboot asked,
    # and it is back in service.
    assert abs(booted(slurm, BAD) - before) <= BOOT_SLACK_S and reboots(slurm) == rebooted
    node = slurm.cli.node(BAD)
    assert not node.flags & {"DRAIN", "REBOOT_REQUESTED", "REBOOT_ISSUED"}, node


@pytest.mark.system
def test_slurm_a_gpu_that_cannot_be_reset_is_rebooted_by_slurm_and_the_step_says_why(
    slurm: Cluster, slurm_runtime: Runtime, tmp_path: Path
) -> None:
    gpu_node = Node(tmp_path, names=(OTHER,))
    gpu_node.answer({GPUS: [(H200, 0)], PROCESSES: [(BUSY, 0)]})  # a process still holds GPU 0
    slurm_runtime.backends.gpu_reset = gpu_node.resetter()
    before = booted(slurm, OTHER)

    outcome = run(slurm_runtime, xid48(OTHER, "slurm-reset-2"))
    verified = outcome.verified is not None and outcome.verified.passed
    assert (outcome.action, outcome.act, verified) == ("reset_gpu", "done", True), outcome.summary
    assert (
        f"GPU reset not done (not reset: pid 561 (python3) holds GPU 0 on {OTHER}); "
        f"rebooting instead: asked Slurm to reboot {OTHER} once idle"
    ) in outcome.summary
    assert not [c for c in gpu_node.calls() if "--gpu-reset" in c or c.startswith("-pm")]
    assert booted(slurm, OTHER) - before > BOOT_SLACK_S
    assert OTHER in reboots(slurm)
    assert not slurm.cli.node(OTHER).flags & {"DRAIN"}  # verified, and returned


# --- the spare pool, held by a Slurm reservation ------------------------------------------------------


@pytest.fixture
def spare_pool(slurm: Cluster) -> Iterator[SlurmScheduler]:
    """The last node held as the one spare; the reservation is gone after the test, whatever it did."""
    scheduler = SlurmScheduler()
    scheduler.refill(NODES[3])
    try:
        yield scheduler
    finally:
        if SPARES_RESERVATION in slurm.cli.reservations():
            slurm.run("scontrol", "delete", f"ReservationName={SPARES_RESERVATION}")


@pytest.mark.system
def test_slurm_the_requeued_job_lands_on_a_spare_and_the_repaired_node_refills_the_pool(
    slurm: Cluster, slurm_runtime: Runtime, spare_pool: SlurmScheduler, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    default = (REPO_ROOT / "policies" / "default.yaml").read_text()
    policy.write_text(default.replace("\nrules:\n", "\nspares:\n  nodes: 1\n\nrules:\n", 1))
    slurm_runtime.policy_path = policy
    assert spare_pool.spare_nodes() == {NODES[3]} and spare_pool.reserved_nodes() == set()
    job_id = slurm.sbatch("--nodes=3", "--exclusive", "--requeue", user="nobody")  # every node but the spare
    bad = slurm.running(job_id).nodes[0]

    event = fault_event("xid", id="slurm-spare-1", node=bad, gpu=0, job=job_id, at=datetime.now(UTC))
    outcome = run(slurm_runtime, [event.model_dump_json()])
    assert (outcome.action, outcome.act) == ("reboot", "done"), outcome.summary
    assert f"spare {NODES[3]} lent to the job" in outcome.summary
    again = slurm.running(job_id)  # on the spare, once its old credential expired; no wait for the reboot
    assert bad not in again.nodes and NODES[3] in again.nodes and again.restarts == 1
    # Verified, the repaired node refills the pool rather than taking work.
    assert outcome.verified is not None and outcome.verified.passed, outcome.summary
    assert f"{bad} refills the spare pool (1 of 1)" in outcome.verified.detail
    assert slurm.cli.reservations()[SPARES_RESERVATION] == [bad]
    assert not slurm.cli.node(bad).flags & {"DRAIN"}
