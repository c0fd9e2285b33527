"""SlurmScheduler and SlurmRebootProvider against a real Slurm cluster on this machine.

scripts/slurm-cluster.sh starts a private munged, slurmctld and four slurmd (gpu-node-1..4, 8 fake GPUs
each) on free ports under a temporary directory. Drains, requeues, resumes and reboot requests go
through Slurm for real; only the machine reboot is a stand-in: the node's slurmd restarts with a fresh
boot time, which is what slurmctld checks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import slurm_cluster
from checkout import REPO_ROOT
from slurm_cluster import NODES, Cluster, until

from medic.integrations.polling import NodeNotBackError
from medic.integrations.registry import Backends
from medic.integrations.slurm import (
    NodeHeldByOthersError,
    NotRequeueableError,
    ResumeRefusedError,
    SlurmCli,
    SlurmCommandError,
    SlurmError,
    SlurmRebootProvider,
    SlurmScheduler,
    UnknownJobError,
    UnknownSlurmNodeError,
)
from medic.integrations.slurm.records import SlurmNode
from medic.protocols import JobState, NodeProvider, NodeState, Reconcilable, Scheduler
from medic.store import Store
from medic.tasks.nodes.reconcile import reconcile_intents
from medic.tasks.runtime.process import Runtime

pytestmark = pytest.mark.system

# The cluster's fixtures (tests/slurm_cluster.py): a cluster for this module, settled after each test.
cluster = slurm_cluster.cluster
slurm = slurm_cluster.slurm


@pytest.fixture
def scheduler(slurm: Cluster) -> SlurmScheduler:
    return SlurmScheduler()


def test_nodes_lists_the_idle_cluster(slurm: Cluster, scheduler: SlurmScheduler) -> None:
    assert isinstance(scheduler, Scheduler)
    nodes = scheduler.nodes()
    assert [n.name for n in nodes] == NODES
    assert {n.state for n in nodes} == {NodeState.IDLE}
    assert {n.gpus for n in nodes} == {8}
    assert all(n.reason is None for n in nodes)
    assert slurm.started_in_s < 10


def test_unknown_names_are_clear_errors(slurm: Cluster, scheduler: SlurmScheduler) -> None:
    for call in (
        lambda: scheduler.node("gpu-node-99"),
        lambda: scheduler.drain("gpu-node-99", "medic: test"),
        lambda: scheduler.resume("gpu-node-99"),
        lambda: scheduler.jobs_on_node("gpu-node-99"),
    ):
        with pytest.raises(UnknownSlurmNodeError, match="gpu-node-99"):
            call()
    assert scheduler.job("999999") is None
    with pytest.raises(UnknownJobError, match="999999"):
        scheduler.requeue("999999", [])


def test_drain_requeue_resume(slurm: Cluster, scheduler: SlurmScheduler) -> None:
    job_id = slurm.sbatch("--nodes=2", "--exclusive", "--requeue", user="nobody")
    first = slurm.running(job_id)
    bad, good = first.nodes

    on_bad = scheduler.jobs_on_node(bad)
    assert [(j.id, j.owner, j.state, j.nodes, j.step) for j in on_bad] == [
        (job_id, "nobody", JobState.RUNNING, (bad, good), None)
    ]

    reason = "medic: xid 79 on GPU 3 incident T1"
    scheduler.drain(bad, reason)
    drained = scheduler.node(bad)
    assert (drained.state, drained.reason, drained.drained_by_medic) == (NodeState.DRAINED, reason, True)
    scheduler.drain(bad, "medic: a second incident")  # already ours: the first reason stays
    assert scheduler.node(bad).reason == reason

    started = time.monotonic()
    requeued = scheduler.requeue(job_id, [bad])
    assert requeued.restarts == 1
    again = slurm.running(job_id)
    seconds = time.monotonic() - started
    print(f"requeue → running again on other nodes: {seconds:.1f} s")
    assert bad not in again.nodes and len(again.nodes) == 2
    assert again.excluded == bad
    assert scheduler.job(job_id) == again.info()
    assert again.info().restarts == 1
    assert scheduler.jobs_on_node(bad) == []
    assert seconds < 30  # cred_expire=10 in the test cluster

    scheduler.resume(bad)
    back = until(lambda: (n := scheduler.node(bad)).state is NodeState.IDLE and n, f"{bad} idle")
    assert back.reason is None


def test_owner_from_the_job_comment(slurm: Cluster, scheduler: SlurmScheduler) -> None:
    job_id = slurm.sbatch("--nodes=1", "--comment=team=vision owner=alice", user="nobody")
    slurm.running(job_id)
    job = scheduler.job(job_id)
    assert job is not None and job.owner == "alice" and job.state is JobState.RUNNING


def test_an_admins_drain_is_never_undone_or_overwritten(slurm: Cluster, scheduler: SlurmScheduler) -> None:
    node = NODES[2]
    slurm.run("scontrol", "update", f"nodename={node}", "state=drain", "reason=admin: bad fan")
    before = scheduler.node(node)
    assert (before.state, before.reason, before.drained_by_medic) == (
        NodeState.DRAINED,
        "admin: bad fan",
        False,
    )

    with pytest.raises(ResumeRefusedError, match="never undone"):
        scheduler.resume(node)
    with pytest.raises(NodeHeldByOthersError, match="admin: bad fan"):
        scheduler.drain(node, "medic: incident X")
    for provider in (SlurmRebootProvider(), SlurmRebootProvider(convention="hyperpod")):
        with pytest.raises(NodeHeldByOthersError):
            provider.reboot(node)
    assert scheduler.node(node) == before
    assert not slurm.cli.node(node).flags & {"REBOOT_REQUESTED", "FAIL"}


def test_resume_refuses_a_node_in_service(slurm: Cluster, scheduler: SlurmScheduler) -> None:
    with pytest.raises(ResumeRefusedError, match="not drained by GPU Medic"):
        scheduler.resume(NODES[0])


def test_requeue_refusals_leave_the_job_running(slurm: Cluster, scheduler: SlurmScheduler) -> None:
    job_id = slurm.sbatch("--nodes=1", "--no-requeue")
    node = slurm.running(job_id).nodes[0]
    with pytest.raises(NotRequeueableError, match=f"job {job_id}.*--no-requeue"):
        scheduler.requeue(job_id, [node])
    with pytest.raises(UnknownSlurmNodeError, match="gpu-node-99"):
        scheduler.requeue(job_id, ["gpu-node-99"])
    job = scheduler.job(job_id)
    assert job is not None and (job.state, job.restarts) == (JobState.RUNNING, 0)


def test_reboots_through_slurm(slurm: Cluster, scheduler: SlurmScheduler) -> None:
    provider = SlurmRebootProvider(poll_interval_s=0.2)
    assert isinstance(provider, NodeProvider)
    rebooted, reset, resumed = NODES[:3]
    scheduler.drain(rebooted, "medic: reboot incident R1")
    scheduler.drain(reset, "medic: reset_gpu incident R2")

    assert "stays drained" in provider.reboot(rebooted)
    assert "a reboot resets GPU 3" in provider.reset_gpu(reset, 3)
    SlurmRebootProvider(resume_after_reboot=True).reboot(resumed)
    for node in (rebooted, reset, resumed):
        assert slurm.cli.node(node).flags & {"REBOOT_REQUESTED", "REBOOT_ISSUED"}
    with pytest.raises(NodeNotBackError, match=f"{rebooted}: not confirmed back"):
        provider.wait_ready(rebooted, 0)  # asked, not yet done: still on the boot it had

    started = time.monotonic()
    assert all(provider.wait_ready(node, 30) for node in (rebooted, reset, resumed))
    print(f"reboot request → node back: {time.monotonic() - started:.1f} s")
    log = (slurm.base / "log" / "reboots.log").read_text()
    assert all(node in log for node in (rebooted, reset, resumed))

    for node, incident in ((rebooted, "R1"), (reset, "R2")):
        after = scheduler.node(node)
        assert after.state is NodeState.DRAINED and after.drained_by_medic, after
        assert f"incident {incident}" in (after.reason or "")
    assert scheduler.node(resumed).state is NodeState.IDLE

    with pytest.raises(SlurmError, match="cannot replace hardware"):
        provider.replace(NODES[3])


def test_ready_only_with_a_later_boot_time(slurm: Cluster, scheduler: SlurmScheduler) -> None:
    node = NODES[3]
    provider = SlurmRebootProvider(poll_interval_s=0.1)
    scheduler.drain(node, "medic: reboot incident B1")
    before = provider.cli.node_and_boot(node)[1]
    provider.reboot(node)
    assert provider.wait_ready(node, 30)
    after = provider.cli.node_and_boot(node)[1]
    assert before is not None and after is not None and after > before
    print(f"BootTime {before} → {after}")
    assert scheduler.node(node).drained_by_medic  # back, still out of service until verified


def test_a_reboot_cut_off_by_a_crash_is_settled_from_slurms_record(
    slurm: Cluster, scheduler: SlurmScheduler, sim_backends: Backends, sqlite_store: Store
) -> None:
    node, idle, busy = NODES[2], NODES[1], NODES[3]
    provider = SlurmRebootProvider(poll_interval_s=0.1)
    assert isinstance(provider, Reconcilable)
    rt = Runtime(
        sqlite_store,
        dataclasses.replace(sim_backends, provider=provider),
        REPO_ROOT / "policies" / "default.yaml",
    )
    scheduler.drain(node, "medic: reboot incident K1")
    sqlite_store.claim_action(f"K1:{node}:reboot", "K1", node, "reboot")
    provider.reboot(node)  # the request went out; the process died before recording it
    sqlite_store.claim_action(f"K2:{idle}:reboot", "K2", idle, "reboot")  # died before the request
    slurm.running(slurm.sbatch("--nodes=1", f"--nodelist={busy}"))
    sqlite_store.claim_action(f"K3:{busy}:reset_gpu", "K3", busy, "reset_gpu")
    provider.reset_gpu(busy, 0)  # accepted, but Slurm reboots only once the job has left
    assert provider.wait_ready(node, 30)

    settled = reconcile_intents(rt, {"K1", "K2", "K3"})
    pending = slurm.cli.node(busy).describe
    slurm.run("scontrol", "cancel_reboot", busy)
    assert sorted(settled) == [
        f"K1:{node}:reboot: done ({node} booted at {scheduler.booted_at(node):%Y-%m-%d %H:%M:%S%z}, after the intent)",
        f"K2:{idle}:reboot: not done ({idle} has not booted since the intent"
        f" (last boot {scheduler.booted_at(idle):%Y-%m-%d %H:%M:%S%z}))",
        f"K3:{busy}:reset_gpu: done ({busy} has it under way in Slurm ({pending}))",
    ]
    done = sqlite_store.get_action(f"K1:{node}:reboot")
    assert done is not None and done.status == "succeeded" and "reconciled" in done.detail
    retried = sqlite_store.get_action(f"K2:{idle}:reboot")
    assert retried is not None and retried.status == "failed"


def test_a_reboot_that_never_happens_is_not_back(slurm: Cluster, scheduler: SlurmScheduler) -> None:
    """The reboot waits for the node's job, then an admin cancels it: the flags clear and the node looks
    normal again, but on the boot it had before. The old check called that ready."""
    node = NODES[3]
    job_id = slurm.sbatch("--nodes=1", f"--nodelist={node}")
    slurm.running(job_id)
    provider = SlurmRebootProvider(poll_interval_s=0.1)
    provider.reboot(node)
    assert slurm.cli.node(node).flags & {"REBOOT_REQUESTED"}
    slurm.run("scontrol", "cancel_reboot", node)
    until(lambda: not slurm.cli.node(node).flags & {"REBOOT_REQUESTED"}, "the reboot to be cancelled")
    started = time.monotonic()
    with pytest.raises(NodeNotBackError, match="never seen to go down") as raised:
        provider.wait_ready(node, 1.5)
    assert time.monotonic() - started >= 1.5
    assert (
        "BootTime" in raised.value.before
        and raised.value.before.split("BootTime ")[1] in raised.value.last_seen
    )


def test_wait_ready_is_false_for_a_node_that_stays_down(slurm: Cluster) -> None:
    slurm.run("scontrol", "update", f"nodename={NODES[3]}", "state=down", "reason=medic: test incident D1")
    started = time.monotonic()
    assert SlurmRebootProvider(poll_interval_s=0.1).wait_ready(NODES[3], 10) is False
    assert time.monotonic() - started < 2  # down without a reboot under way is final: no waiting


def test_hyperpod_convention(slurm: Cluster, scheduler: SlurmScheduler) -> None:
    provider = SlurmRebootProvider(convention="hyperpod", poll_interval_s=0.1)
    scheduler.drain(NODES[0], "medic: reboot incident H1")
    provider.reboot(NODES[0])
    provider.replace(NODES[1])
    assert "a reboot resets all GPUs" in provider.reset_gpu(NODES[2], None)

    for node, reason in (
        (NODES[0], "Action:Reboot"),
        (NODES[1], "Action:Replace"),
        (NODES[2], "Action:Reboot"),
    ):
        raw = slurm.cli.node(node)
        assert "FAIL" in raw.flags and raw.reason == reason
        info = scheduler.node(node)
        assert info.state is NodeState.DRAINED and not info.drained_by_medic
    # Until HyperPod's agent takes the node through repair and back (a new BootTime), it is not ready.
    with pytest.raises(NodeNotBackError, match=f"{NODES[0]}: not confirmed back .*after the reboot"):
        provider.wait_ready(NODES[0], 0.3)


def test_a_cluster_that_does_not_answer_is_an_error_not_a_hang() -> None:
    # Without a readable config sinfo goes looking for a controller and waits: the timeout ends it.
    cli = SlurmCli(slurm_conf="/nonexistent/slurm.conf", timeout_s=1)
    with pytest.raises(SlurmCommandError, match=r"sinfo --json.*no answer within 1 s"):
        cli.nodes()


def test_provider_convention_from_env() -> None:
    assert SlurmRebootProvider.from_env({}).convention == "scontrol"
    assert SlurmRebootProvider.from_env({"SLURM_CONF": "/etc/x.conf"}).cli.slurm_conf == "/etc/x.conf"
    assert SlurmRebootProvider.from_env({"MEDIC_SLURM_ACTIONS": "hyperpod"}).convention == "hyperpod"
    with pytest.raises(ValueError, match="MEDIC_SLURM_ACTIONS"):
        SlurmRebootProvider.from_env({"MEDIC_SLURM_ACTIONS": "ipmi"})


@pytest.mark.parametrize(
    ("base", "flags", "expected"),
    [
        ("idle", [], NodeState.IDLE),
        ("mixed", [], NodeState.ALLOCATED),
        ("mixed", ["DRAIN"], NodeState.DRAINED),
        ("idle", ["FAIL"], NodeState.DRAINED),
        ("idle", ["DRAIN", "REBOOT_REQUESTED"], NodeState.DRAINED),
        ("idle", ["REBOOT_REQUESTED"], NodeState.REBOOTING),
        ("down", ["DRAIN", "REBOOT_ISSUED"], NodeState.REBOOTING),
        ("down", ["NOT_RESPONDING"], NodeState.DOWN),
        ("idle", ["NOT_RESPONDING"], NodeState.UNKNOWN),
        ("future", [], NodeState.UNKNOWN),
    ],
)
def test_node_state_mapping(base: str, flags: list[str], expected: NodeState) -> None:
    raw = {
        "name": "n",
        "state": base,
        "state_flags": flags,
        "reason": "",
        "gres": "gpu:a100:4(S:0-1),gpu:2,nic:1",
    }
    node = SlurmNode.from_json(raw)
    assert (node.state, node.gpus, node.reason) == (expected, 6, None)


# --- end to end: `medic ingest` remediating through the real cluster ----------------------------


def _ingest(
    slurm: Cluster, tmp_path: Path, events: list[dict[str, object]]
) -> subprocess.CompletedProcess[str]:
    feed = tmp_path / "events.jsonl"
    feed.write_text("".join(json.dumps(e) + "\n" for e in events))
    env = {
        **os.environ,
        "MEDIC_SCHEDULER": "slurm",
        "MEDIC_PROVIDER": "slurm",
        "MEDIC_HOME": str(tmp_path),
        "MEDIC_DATABASE_URL": f"sqlite:///{tmp_path / 'medic.db'}",
        "SLURM_CONF": str(slurm.base / "etc" / "slurm.conf"),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    medic = Path(sys.executable).parent / "medic"
    return subprocess.run(
        [str(medic), "ingest", str(feed)], env=env, capture_output=True, text=True, timeout=400
    )


def _xid79(node: str, job: str, event_id: str) -> dict[str, object]:
    now = datetime.now(UTC).isoformat()
    return {
        "id": event_id,
        "time": now,
        "source": "agent",
        "kind": "xid",
        "node": node,
        "gpu": 0,
        "job": job,
        "attributes": {"code": 79},
    }


def test_ingest_xid79_drains_requeues_reboots_verifies_and_resumes(slurm: Cluster, tmp_path: Path) -> None:
    job_id = slurm.sbatch("--nodes=2", "--exclusive", "--requeue", user="nobody")
    job = slurm.running(job_id)
    bad, kept = job.nodes[0], job.nodes[1]
    event = _xid79(bad, job_id, "slurm-e2e-1")
    done = _ingest(slurm, tmp_path, [event])
    assert done.returncode == 0, done.stdout + done.stderr

    store = Store(f"sqlite:///{tmp_path / 'medic.db'}")
    (incident,) = store.find_incidents(node=bad)
    assert (incident.action, incident.status) == ("reboot", "closed"), incident.outcome
    detail = store.incident_detail(incident.id)
    assert detail is not None
    # The job was moved off before the reboot (docs/decisions/0008), then waited on, not requeued again.
    assert {a.action: a.status for a in detail.actions} == {
        "drain": "succeeded",
        "requeue": "succeeded",
        "reboot": "succeeded",
        "resume": "succeeded",
    }
    # The job runs again, elsewhere; the node was verified and is back in service.
    requeued = slurm.running(job_id)
    assert bad not in requeued.nodes and requeued.restarts == 1
    node = next(n for n in slurm.cli.nodes() if n.name == bad)
    assert not node.flags & {"DRAIN", "FAIL"}, node
    assert kept  # the job's other node was not touched by us
    assert not [a for a in detail.actions if a.node != bad]

    # The same event again: one action per fault, never two.
    again = _ingest(slurm, tmp_path, [event])
    assert again.returncode == 0, again.stderr
    assert len(store.incident_detail(incident.id).actions) == 4  # type: ignore[union-attr]


def test_ingest_leaves_an_admin_drained_node_alone(slurm: Cluster, tmp_path: Path) -> None:
    slurm.run("scontrol", "update", "nodename=gpu-node-4", "state=drain", "reason=admin: bad fan")
    done = _ingest(slurm, tmp_path, [_xid79("gpu-node-4", "none", "slurm-e2e-admin")])
    assert done.returncode == 0, done.stdout + done.stderr
    store = Store(f"sqlite:///{tmp_path / 'medic.db'}")
    (incident,) = store.find_incidents(node="gpu-node-4")
    assert incident.status == "escalated"
    node = next(n for n in slurm.cli.nodes() if n.name == "gpu-node-4")
    assert node.reason == "admin: bad fan"
    assert "DRAIN" in node.flags
