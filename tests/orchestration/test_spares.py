"""The spare pool in a remediation (docs/spares.md), run for real on Prefect (test harness) over the
simulated fleet: a spare is lent when the job is requeued off a node that must go, so the job runs again
at once; the repaired node, verified, refills the pool; each once per incident; an empty pool says so
and the repair goes on; the pool's nodes are no sweep's and count as in service."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from checkout import REPO_ROOT
from factories import fault_event
from hyperpod_support import CLUSTER, expect_batch, expect_listing, expect_status, iid, summary

from medic.flows.dispatch import Dispatch, remediate_all
from medic.flows.remediate import Outcome
from medic.intake import read_lines
from medic.integrations import registry
from medic.integrations.hyperpod import HyperPodProvider
from medic.integrations.sim.fleet import SimFleet, SimNode
from medic.protocols import NodeState
from medic.store import Store
from medic.tasks.nodes.spares import lend_spare
from medic.tasks.runtime.process import Runtime, configure

pytestmark = pytest.mark.usefixtures("prefect_harness")

T0 = datetime.now(UTC) - timedelta(minutes=5)
BAD, OTHER, SPARE = "gpu-node-1", "gpu-node-2", "gpu-node-3"


@pytest.fixture
def fleet() -> SimFleet:
    """Three nodes: the job on two, the third a spare, so the job has nowhere else to go."""
    fleet = SimFleet.build(nodes=3)
    fleet.add_job("llm", "alice", [BAD, OTHER], step=1_234, checkpoint_every=100)
    fleet.crash_job("llm")
    return fleet


def with_spares(tmp_path: Path, nodes: int) -> Path:
    policy = tmp_path / "policy.yaml"
    default = (REPO_ROOT / "policies" / "default.yaml").read_text()
    policy.write_text(default.replace("\nrules:\n", f"\nspares:\n  nodes: {nodes}\n\nrules:\n", 1))
    return policy


@pytest.fixture
def runtime(sqlite_store: Store, fleet: SimFleet, tmp_path: Path) -> Runtime:
    backends = registry.simulated(fleet)[0]
    assert backends.spare_pool is not None
    backends.spare_pool.refill(SPARE)
    return configure(Runtime(sqlite_store, backends, with_spares(tmp_path, 1)))


def xid79(rt: Runtime, event_id: str = "ev-79") -> Outcome:
    event = fault_event("xid", id=event_id, node=BAD, gpu=3, job="llm", at=T0, attributes={"code": 79})
    dispatch: Dispatch = asyncio.run(remediate_all(rt, read_lines([event.model_dump_json()], "s.jsonl")))
    assert not dispatch.failed, dispatch.failed
    (outcome,) = dispatch.outcomes
    return outcome


def test_a_spare_takes_the_job_and_the_repaired_node_refills_the_pool(
    runtime: Runtime, fleet: SimFleet
) -> None:
    pool = runtime.backends.spare_pool
    assert pool is not None and pool.spare_nodes() == {SPARE}
    assert (
        runtime.backends.reservations is not None and runtime.backends.reservations.reserved_nodes() == set()
    )

    outcome = xid79(runtime)
    assert (outcome.action, outcome.act) == ("reboot", "done"), outcome.summary
    assert outcome.resumed is not None and sorted(outcome.resumed.nodes) == [OTHER, SPARE]
    assert f"spare {SPARE} lent to the job" in outcome.summary
    assert outcome.verified is not None and outcome.verified.passed
    assert f"{BAD} refills the spare pool (1 of 1)" in outcome.verified.detail
    assert pool.spare_nodes() == {BAD} and fleet.node(BAD).state is NodeState.IDLE
    actions = {a.action: a.status for a in runtime.store.incident_detail(outcome.incident).actions}  # type: ignore[union-attr]
    assert (actions["lend_spare"], actions["refill_spares"]) == ("succeeded", "succeeded")
    assert [c for c in fleet.calls if c[1] in ("lend", "refill")] == [
        (SPARE, "refill"),
        (SPARE, "lend"),
        (BAD, "refill"),
    ]


def test_an_empty_pool_says_so_and_the_repair_goes_on(runtime: Runtime, fleet: SimFleet) -> None:
    pool = runtime.backends.spare_pool
    assert pool is not None and pool.lend() == SPARE  # someone else took it: the pool is empty
    outcome = xid79(runtime, "ev-empty")
    assert (outcome.action, outcome.act) == ("reboot", "done"), outcome.summary
    assert "no spare lent: the pool is empty, so the job waits for a free node" in outcome.summary
    assert outcome.resumed is not None and sorted(outcome.resumed.nodes) == [OTHER, SPARE]  # free now
    assert pool.spare_nodes() == {BAD}  # the pool is short: the repaired node refills it


def test_an_empty_pool_is_the_answer_for_the_incident_even_once_the_repaired_node_refills_it(
    runtime: Runtime,
) -> None:
    """The job's requeue asks for the spare again after the flow asked: by then the repaired node may
    be verified and in the pool, and must not be lent to the job it was taken off (a failed claim may
    otherwise be taken again)."""
    pool = runtime.backends.spare_pool
    assert pool is not None and pool.lend() == SPARE
    first = lend_spare(runtime, "inc-empty", BAD)
    assert first == "no spare lent: the pool is empty, so the job waits for a free node"
    pool.refill(BAD)  # verified meanwhile
    assert lend_spare(runtime, "inc-empty", BAD) == first
    assert pool.spare_nodes() == {BAD}


def test_without_spares_in_the_policy_the_pool_is_left_alone(
    runtime: Runtime, fleet: SimFleet, tmp_path: Path
) -> None:
    runtime.policy_path = with_spares(tmp_path, 0)
    pool = runtime.backends.spare_pool
    assert pool is not None
    fleet.nodes["gpu-node-4"] = SimNode("gpu-node-4", switch="leaf-1", gpus=8)  # where the job goes
    outcome = xid79(runtime, "ev-none")
    assert "spare" not in outcome.summary
    assert (
        pool.spare_nodes() == {SPARE} and outcome.resumed is not None and SPARE not in outcome.resumed.nodes
    )


# --- HyperPod: the replacement flow with a spare -------------------------------------------------------


def replacing(tmp_path: Path) -> Path:
    """The default policy with a spare, where XID 79 replaces the node without asking."""
    policy = with_spares(tmp_path, 1)
    text = policy.read_text()
    fallen = "      xid: [79]\n    then:\n      classification: hardware\n      action: reboot\n"
    assert fallen in text and "required_for: [replace]" in text
    policy.write_text(
        text.replace(fallen, fallen.replace("reboot", "replace")).replace(
            "required_for: [replace]", "required_for: []"
        )
    )
    return policy


def test_hyperpod_a_spare_takes_the_job_while_the_node_is_replaced_and_the_new_one_refills_the_pool(
    sqlite_store: Store, fleet: SimFleet, tmp_path: Path
) -> None:
    """SageMaker HyperPod's Slurm keeps the pool as any Slurm does (here the simulated scheduler's);
    HyperPod replaces the node (BatchReplaceClusterNodes, botocore's Stubber answering as SageMaker),
    and the new instance, found by the node's logical id and verified, refills the pool."""
    client = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    ).client("sagemaker")
    names = [BAD, OTHER, SPARE]
    before = [summary(iid(n), f"10.1.0.{n}", logical=name) for n, name in enumerate(names, 1)]
    after = [summary(iid(7), "10.1.0.7", logical=BAD), *before[1:]]
    with Stubber(client) as stub:
        expect_listing(stub, [before])  # the names discovered
        expect_listing(stub, [before])  # who holds the node, before the request
        expect_batch(stub, "batch_replace_cluster_nodes", [iid(1)])
        expect_listing(stub, [after])  # the node's logical id, on a new instance
        expect_status(stub, iid(7), "Running")
        backends = registry.simulated(fleet)[0]
        backends.provider = HyperPodProvider(client, CLUSTER, poll_interval_s=0.01)
        assert backends.spare_pool is not None
        backends.spare_pool.refill(SPARE)
        rt = configure(Runtime(sqlite_store, backends, replacing(tmp_path)))

        outcome = xid79(rt)
        stub.assert_no_pending_responses()

    assert (outcome.action, outcome.act) == ("replace", "done"), outcome.summary
    assert f"spare {SPARE} lent to the job" in outcome.summary
    assert outcome.resumed is not None and sorted(outcome.resumed.nodes) == [OTHER, SPARE]
    assert outcome.verified is not None and outcome.verified.passed, outcome.summary
    assert f"{BAD} refills the spare pool (1 of 1)" in outcome.verified.detail
    assert backends.spare_pool.spare_nodes() == {BAD}
