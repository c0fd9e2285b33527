"""HyperPodProvider against a real boto3 SageMaker client whose calls botocore's Stubber answers.

moto does not implement the batch reboot/replace APIs, so the Stubber plays AWS: it checks every request
and canned response against the SageMaker service model botocore ships. What it does not check (the
25-id limit, the id pattern) the provider must, and these tests hold it to that.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import boto3
import pytest
from botocore.client import BaseClient
from botocore.stub import Stubber
from fake_time import FakeTime
from hyperpod_support import (
    CLUSTER,
    LAUNCHED,
    expect_batch,
    expect_listed,
    expect_listing,
    expect_status,
    expect_throttled,
    iid,
    summary,
)

from medic.errors import PermanentError, is_transient
from medic.integrations.aws_retry import RetryPolicy
from medic.integrations.hyperpod import HELD, HyperPodProvider
from medic.integrations.polling import NodeHeldError, NodeNotBackError
from medic.integrations.provider_errors import (
    InvalidNodeIdError,
    NodeActionError,
    PermanentNodeActionError,
    UnknownNodeError,
)
from medic.protocols import NodeInfo, NodeProvider, NodeState, Reconcilable


@pytest.fixture
def client() -> BaseClient:
    session = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )
    return session.client("sagemaker")


@pytest.fixture
def stub(client: BaseClient) -> Iterator[Stubber]:
    with Stubber(client) as stubber:
        yield stubber
        stubber.assert_no_pending_responses()


@pytest.fixture
def fake_time() -> FakeTime:
    return FakeTime()


def provider(
    client: BaseClient, fake_time: FakeTime, node_ids: dict[str, str] | None, attempts: int = 4
) -> HyperPodProvider:
    return HyperPodProvider(
        client,
        CLUSTER,
        node_ids,
        retry=RetryPolicy(attempts=attempts, base_s=1.0, cap_s=8.0),
        poll_interval_s=10.0,
        sleep=fake_time.sleep,
        clock=fake_time.clock,
    )


def test_reboot_one_node(client: BaseClient, stub: Stubber, fake_time: FakeTime) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    assert isinstance(hp, NodeProvider)
    expect_listed(stub, [iid(1)])
    expect_batch(stub, "batch_reboot_cluster_nodes", [iid(1)])
    assert hp.reboot("gpu-1") == f"HyperPod accepted the reboot of gpu-1 ({iid(1)})"
    assert fake_time.sleeps == []


def test_sixty_nodes_go_in_chunks_of_25(client: BaseClient, stub: Stubber, fake_time: FakeTime) -> None:
    ids = {f"gpu-{n:02d}": iid(n) for n in range(60)}
    hp = provider(client, fake_time, ids)
    all_ids = list(ids.values())
    expect_listed(stub, all_ids)
    for chunk in (all_ids[:25], all_ids[25:50], all_ids[50:]):
        expect_batch(stub, "batch_replace_cluster_nodes", chunk)
    outcomes = hp.batch_replace(ids)
    assert len(outcomes) == 60
    assert all(o.ok for o in outcomes.values())
    assert outcomes["gpu-59"].node_id == iid(59)


def test_partial_failure_is_reported_per_node_and_not_retried(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    hp = provider(client, fake_time, {"a": iid(1), "b": iid(2), "c": iid(3)})
    failure = {"NodeId": iid(2), "ErrorCode": "InvalidInstanceStatus", "Message": "node is pending"}
    expect_listed(stub, [iid(1), iid(2), iid(3)])
    expect_batch(stub, "batch_reboot_cluster_nodes", [iid(1), iid(2), iid(3)], failed=[failure])
    outcomes = hp.batch_reboot(["a", "b", "c"])
    assert [outcomes[n].ok for n in "abc"] == [True, False, True]
    assert outcomes["b"].code == "InvalidInstanceStatus"
    assert outcomes["b"].detail == "node is pending"
    # One call only (the Stubber would fail on a second): neither the failed node nor the others re-sent.

    expect_listed(stub, [iid(2)])
    expect_batch(stub, "batch_reboot_cluster_nodes", [iid(2)], failed=[failure])
    with pytest.raises(NodeActionError) as raised:
        hp.reboot("b")
    assert (raised.value.node, raised.value.code) == ("b", "InvalidInstanceStatus")


def test_throttling_is_retried_with_growing_jittered_backoff(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    expect_listed(stub, [iid(1)])
    expect_throttled(stub, "batch_reboot_cluster_nodes", [iid(1)])
    expect_throttled(stub, "batch_reboot_cluster_nodes", [iid(1)])
    expect_batch(stub, "batch_reboot_cluster_nodes", [iid(1)])
    assert "accepted the reboot" in hp.reboot("gpu-1")
    first, second = fake_time.sleeps
    assert 0.5 <= first <= 1.0  # step 1 s: half of it plus up to half again
    assert 1.0 <= second <= 2.0  # step 2 s


def test_throttling_forever_gives_up_after_the_attempt_bound(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)}, attempts=3)
    expect_listed(stub, [iid(1)])
    for _ in range(3):
        expect_throttled(stub, "batch_replace_cluster_nodes", [iid(1)])
    with pytest.raises(NodeActionError) as raised:
        hp.replace("gpu-1")
    assert raised.value.code == "ThrottlingException"
    assert "after 3 attempts" in raised.value.message
    assert len(fake_time.sleeps) == 2


def test_a_throttled_chunk_fails_alone(client: BaseClient, stub: Stubber, fake_time: FakeTime) -> None:
    ids = {f"gpu-{n:02d}": iid(n) for n in range(30)}
    hp = provider(client, fake_time, ids, attempts=1)
    all_ids = list(ids.values())
    expect_listed(stub, all_ids)
    expect_batch(stub, "batch_reboot_cluster_nodes", all_ids[:25])
    expect_throttled(stub, "batch_reboot_cluster_nodes", all_ids[25:])
    outcomes = hp.batch_reboot(ids)
    assert sum(o.ok for o in outcomes.values()) == 25
    assert {o.code for o in outcomes.values() if not o.ok} == {"ThrottlingException"}


@pytest.mark.parametrize(
    "bad_id",
    ["i-0123456789abcdef", "i-0123456789ABCDEF0", "0123456789abcdef0", "i-0123456789abcdef0 "],
)
def test_malformed_ids_are_rejected_before_any_call(
    client: BaseClient, stub: Stubber, fake_time: FakeTime, bad_id: str
) -> None:
    with pytest.raises(InvalidNodeIdError):
        provider(client, fake_time, {"gpu-1": iid(1), "gpu-2": bad_id})


def test_a_malformed_discovered_id_stops_the_whole_batch(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    expect_listing(stub, [[summary(iid(1), "10.1.0.1"), summary("i-bad", "10.1.0.2")]])
    hp = provider(client, fake_time, None)
    with pytest.raises(InvalidNodeIdError):
        hp.batch_reboot(["ip-10-1-0-1", "ip-10-1-0-2"])  # no batch call queued: none may be made


def test_bad_cluster_name_is_rejected(client: BaseClient, fake_time: FakeTime) -> None:
    with pytest.raises(ValueError, match="cluster"):
        HyperPodProvider(client, "not a cluster!", {})


def test_names_are_discovered_across_pages(client: BaseClient, stub: Stubber, fake_time: FakeTime) -> None:
    expect_listing(
        stub,
        [
            [summary(iid(1), "10.1.0.1"), summary(iid(2), "10.1.0.2", logical="workers-2")],
            [summary(iid(3), "10.1.0.3")],
        ],
    )
    hp = provider(client, fake_time, None)
    assert hp.node_id("ip-10-1-0-3") == iid(3)  # the Slurm-style short hostname, found on page 2
    assert hp.node_id("ip-10-1-0-1.ec2.internal") == iid(1)
    assert hp.node_id("workers-2") == iid(2)
    assert hp.node_id(iid(2)) == iid(2)
    expect_listing(stub, [[summary(iid(3), "10.1.0.3")]])
    expect_batch(stub, "batch_reboot_cluster_nodes", [iid(3)])
    assert iid(3) in hp.reboot("ip-10-1-0-3")

    # An unknown name is looked up afresh once (the cluster may have grown), then refused.
    expect_listing(stub, [[summary(iid(1), "10.1.0.1")]])
    with pytest.raises(UnknownNodeError, match="ip-10-9-9-9"):
        hp.reboot("ip-10-9-9-9")


def test_wait_ready_polls_until_running(client: BaseClient, stub: Stubber, fake_time: FakeTime) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    for status in ("ShuttingDown", "Pending", "Running"):
        expect_status(stub, iid(1), status)
    assert hp.wait_ready("gpu-1", timeout_s=600)
    assert fake_time.sleeps == [10.0, 10.0]


def test_wait_ready_times_out(client: BaseClient, stub: Stubber, fake_time: FakeTime) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    for _ in range(4):  # at t = 0, 10, 20, 25
        expect_status(stub, iid(1), "Pending")
    assert not hp.wait_ready("gpu-1", timeout_s=25)
    assert fake_time.now == 25


def test_wait_ready_follows_a_replacement_by_logical_id(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    expect_listing(stub, [[summary(iid(1), "10.1.0.1", logical="workers-1")]])
    hp = provider(client, fake_time, None)
    expect_listing(stub, [[summary(iid(1), "10.1.0.1", logical="workers-1")]])
    expect_batch(stub, "batch_replace_cluster_nodes", [iid(1)])
    hp.replace("workers-1")
    # The listing still shows the old instance at first: it must not count as the node being back.
    expect_listing(stub, [[summary(iid(1), "10.1.0.1", logical="workers-1")]])
    expect_listing(stub, [[summary(iid(7), "10.1.0.7", logical="workers-1")]])
    # The new instance is the proof the node went away: Running is enough from there.
    expect_status(stub, iid(7), "Running")
    assert hp.wait_ready("workers-1", timeout_s=600)
    assert hp.node_id("workers-1") == iid(7)
    assert fake_time.sleeps == [10.0]


def test_an_explicit_map_cannot_follow_a_replacement(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    expect_listed(stub, [iid(1)])
    expect_batch(stub, "batch_replace_cluster_nodes", [iid(1)])
    hp.replace("gpu-1")
    assert not hp.wait_ready("gpu-1", timeout_s=600)  # at once, and with no API call
    assert fake_time.now == 0


def test_reset_gpu_reboots_and_says_so(client: BaseClient, stub: Stubber, fake_time: FakeTime) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    expect_listed(stub, [iid(1)])
    expect_batch(stub, "batch_reboot_cluster_nodes", [iid(1)])
    done = hp.reset_gpu("gpu-1", 3)
    assert done.startswith("HyperPod has no GPU reset API, so the node was rebooted")
    assert "GPU 3" in done


def test_from_env(tmp_path: Path) -> None:
    node_map = tmp_path / "nodes.yaml"
    node_map.write_text(f"gpu-1: {iid(1)}\n")
    env = {"MEDIC_HYPERPOD_CLUSTER": CLUSTER, "AWS_REGION": "us-west-2", "MEDIC_AWS_NODE_MAP": str(node_map)}
    hp = HyperPodProvider.from_env(env)
    assert hp.client.meta.region_name == "us-west-2"
    assert hp.cluster_name == CLUSTER
    assert hp.node_id("gpu-1") == iid(1)
    with pytest.raises(ValueError, match="MEDIC_HYPERPOD_CLUSTER"):
        HyperPodProvider.from_env({"AWS_REGION": "us-west-2"})


def test_still_running_right_after_a_reboot_is_not_ready(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    expect_listed(stub, [iid(1)])
    expect_batch(stub, "batch_reboot_cluster_nodes", [iid(1)])
    hp.reboot("gpu-1")
    # HyperPod still says Running at first: the node has not left yet.
    for status in ("Running", "Running", "Pending", "Running"):
        expect_status(stub, iid(1), status, LAUNCHED)
    assert hp.wait_ready("gpu-1", timeout_s=600)
    assert fake_time.sleeps == [10.0, 10.0, 10.0]


def test_a_later_launch_time_is_proof_too(client: BaseClient, stub: Stubber, fake_time: FakeTime) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    expect_listed(stub, [iid(1)])
    expect_batch(stub, "batch_reboot_cluster_nodes", [iid(1)])
    hp.reboot("gpu-1")
    expect_status(stub, iid(1), "Running", LAUNCHED)
    expect_status(stub, iid(1), "Running", datetime(2026, 11, 2, tzinfo=UTC))
    assert hp.wait_ready("gpu-1", timeout_s=600)


def test_a_reboot_never_seen_leaving_running_times_out_as_a_permanent_error(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    expect_listed(stub, [iid(1)])
    expect_batch(stub, "batch_reboot_cluster_nodes", [iid(1)])
    hp.reboot("gpu-1")
    for _ in range(4):  # at t = 0, 10, 20, 25
        expect_status(stub, iid(1), "Running", LAUNCHED)
    with pytest.raises(NodeNotBackError, match="never seen to go down") as raised:
        hp.wait_ready("gpu-1", timeout_s=25)
    error = raised.value
    assert isinstance(error, PermanentError) and not is_transient(error)
    assert (error.node, error.action, error.waited_s) == ("gpu-1", "reboot", 25)
    assert f"{iid(1)} Running" in error.before and f"{iid(1)} Running" in error.last_seen
    assert fake_time.now == 25


def test_a_node_that_goes_away_and_stays_away_times_out(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    expect_listed(stub, [iid(1)])
    expect_batch(stub, "batch_reboot_cluster_nodes", [iid(1)])
    hp.reboot("gpu-1")
    for status in ("ShuttingDown", "Pending", "Pending"):
        expect_status(stub, iid(1), status, LAUNCHED)
    with pytest.raises(NodeNotBackError, match=r"went away but was not seen back.*Pending"):
        hp.wait_ready("gpu-1", timeout_s=20)


@pytest.mark.parametrize("status", ["Pending", "ShuttingDown", "SystemUpdating", "DeepHealthCheckInProgress"])
def test_a_node_another_operation_has_is_refused_without_a_call(
    client: BaseClient, stub: Stubber, fake_time: FakeTime, status: str
) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    for action in ("reboot", "replace", "reset_gpu"):
        expect_listed(stub, [iid(1)], status=status)
        call = getattr(hp, action)
        with pytest.raises(NodeHeldError, match=f"gpu-1 is held by HyperPod \\(status {status}"):
            call("gpu-1", 0) if action == "reset_gpu" else call("gpu-1")
    # No batch call was queued: the Stubber fails any that is made, and the fixture checks none is left.


def test_a_batch_sends_only_the_nodes_nobody_else_holds(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    hp = provider(client, fake_time, {"a": iid(1), "b": iid(2), "c": iid(3)})
    expect_listing(
        stub,
        [[summary(iid(1), "10.1.0.1"), summary(iid(2), "10.1.0.2", status="SystemUpdating")]],
    )
    expect_batch(stub, "batch_reboot_cluster_nodes", [iid(1)])
    outcomes = hp.batch_reboot(["a", "b", "c"])
    assert outcomes["a"].ok
    assert (outcomes["b"].ok, outcomes["b"].code, outcomes["b"].transient) == (False, HELD, False)
    assert outcomes["b"].held_by is not None and "SystemUpdating" in outcomes["b"].held_by
    assert (outcomes["c"].ok, outcomes["c"].code) == (False, "NotListed")

    expect_listing(stub, [[summary(iid(1), "10.1.0.1")]])
    with pytest.raises(PermanentNodeActionError, match="c: NotListed"):
        hp.reboot("c")


class Drained:
    """A scheduler that shows every node drained with one reason (only `node` is consulted)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def node(self, name: str) -> NodeInfo:
        return NodeInfo(name=name, state=NodeState.DRAINED, reason=self.reason)


def test_a_node_drained_by_an_admin_is_refused_without_a_call(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    hp = HyperPodProvider(client, CLUSTER, {"gpu-1": iid(1)}, scheduler=Drained("admin: bad fan"))
    expect_listed(stub, [iid(1)])
    with pytest.raises(NodeHeldError, match=r"held by the scheduler \(drained, reason: admin: bad fan\)"):
        hp.replace("gpu-1")
    ours = HyperPodProvider(
        client, CLUSTER, {"gpu-1": iid(1)}, scheduler=Drained("medic: replace incident 4")
    )
    expect_listed(stub, [iid(1)])
    expect_batch(stub, "batch_replace_cluster_nodes", [iid(1)])
    assert "accepted the replacement" in ours.replace("gpu-1")


INTENT = datetime(2026, 11, 2, 12, 0, tzinfo=UTC)  # when the lost request's intent was written


class BootRecord:
    """A scheduler that keeps each node's boot time, as Slurm's BootTime does (only `booted_at` is read)."""

    def __init__(self, booted: datetime | None) -> None:
        self.booted = booted

    def booted_at(self, name: str) -> datetime | None:
        return self.booted


def test_a_replacement_cut_off_by_a_crash_is_settled_from_hyperpod(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    """After a restart nothing of the request is left in memory: the node's record in HyperPod tells."""
    expect_listing(stub, [[summary(iid(7), "10.1.0.7", logical="workers-1")]])
    hp = provider(client, fake_time, None)
    assert isinstance(hp, Reconcilable)
    expect_status(stub, iid(7), "Running", datetime(2026, 11, 2, 12, 9, tzinfo=UTC))  # the new instance
    done = hp.settle("workers-1", "replace", INTENT)
    assert done is not None and done.done
    assert done.detail == f"workers-1: {iid(7)} Running, launched 2026-11-02 12:09:00+0000, after the intent"

    mapped = provider(client, fake_time, {"gpu-1": iid(1)})
    stub.add_client_error(
        "describe_cluster_node",
        "ResourceNotFound",
        "not found",
        expected_params={"ClusterName": CLUSTER, "NodeId": iid(1)},
    )
    gone = mapped.settle("gpu-1", "replace", INTENT)
    assert gone is not None and gone.done and "no longer in cluster" in gone.detail


def test_a_reboot_under_way_is_done_and_an_unchanged_node_proves_nothing(
    client: BaseClient, stub: Stubber, fake_time: FakeTime
) -> None:
    hp = provider(client, fake_time, {"gpu-1": iid(1)})
    expect_status(stub, iid(1), "Pending", LAUNCHED)
    pending = hp.settle("gpu-1", "reboot", INTENT)
    assert pending is not None and pending.done and pending.detail.endswith("under way in HyperPod")
    # Running on its old launch: the queued reboot may not have started. Never "not done" (a second
    # reboot), only "cannot tell", unless the scheduler saw the node boot since.
    expect_status(stub, iid(1), "Running", LAUNCHED)
    assert hp.settle("gpu-1", "reboot", INTENT) is None
    for booted, settled in (
        (datetime(2026, 11, 1, tzinfo=UTC), False),
        (datetime(2026, 11, 2, 12, 4, tzinfo=UTC), True),
    ):
        witnessed = HyperPodProvider(client, CLUSTER, {"gpu-1": iid(1)}, scheduler=BootRecord(booted))
        expect_status(stub, iid(1), "Running", LAUNCHED)
        answer = witnessed.settle("gpu-1", "reset_gpu", INTENT)
        assert (answer is not None and answer.done) is settled
        assert answer is None or answer.detail == "gpu-1 booted at 2026-11-02 12:04:00+0000, after the intent"
