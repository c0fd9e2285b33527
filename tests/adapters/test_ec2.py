"""Ec2Provider against moto's server (a real HTTP endpoint on 127.0.0.1) through real boto3 clients.

What moto does and does not do, as found here: RebootInstances, TerminateInstances, SetInstanceHealth,
DescribeInstanceStatus (running instances report both checks ok) and tag/DNS filters work. SetInstanceHealth
only records Unhealthy: moto's Auto Scaling never acts on it, whereas AWS terminates the instance and
launches a replacement. moto does launch a replacement when an Auto Scaling instance is terminated, so
the ASG test performs that one step of AWS's itself and lets moto do the rest. moto ignores wildcards in
the private-dns-name filter, so short hostnames (ip-10-1-2-3) are not exercised here.

moto's RebootInstances changes nothing observable (running, both checks ok, same LaunchTime): exactly the
"it never left" case `wait_ready` must not take for ready. Where a test needs the instance to go away and
come back, it plays AWS's part between two polls with a stop and a start, the one way moto shows an
instance leaving readiness (AWS itself shows a rebooting instance failing its status checks).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.client import BaseClient
from checkout import REPO_ROOT
from fake_time import FakeTime

from medic.errors import PermanentError, is_transient
from medic.integrations.ec2 import HOLDER_TAG, Ec2Provider
from medic.integrations.polling import NodeHeldError, NodeNotBackError
from medic.integrations.provider_errors import ProviderError, UnknownNodeError
from medic.integrations.registry import Backends
from medic.protocols import NodeInfo, NodeProvider, NodeState, Reconcilable
from medic.store import Store
from medic.tasks.nodes.reconcile import reconcile_intents
from medic.tasks.runtime.process import Runtime

REGION = "us-east-1"
AMI = "ami-12345678"
DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path_factory.mktemp("moto") / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not start:\n{log_path.read_text()}")
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture
def endpoint(moto_endpoint: str) -> str:
    """Each test starts with an empty AWS."""
    urllib.request.urlopen(urllib.request.Request(f"{moto_endpoint}/moto-api/reset", method="POST")).close()
    return moto_endpoint


def client(service: str, endpoint: str) -> BaseClient:
    session = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION
    )
    return session.client(service, endpoint_url=endpoint)


@pytest.fixture
def ec2(endpoint: str) -> BaseClient:
    return client("ec2", endpoint)


@pytest.fixture
def autoscaling(endpoint: str) -> BaseClient:
    return client("autoscaling", endpoint)


def provider(
    ec2: BaseClient, autoscaling: BaseClient | None, ids: dict[str, str] | None = None
) -> Ec2Provider:
    return Ec2Provider(ec2, autoscaling, ids, poll_interval_s=0.05)


def launch(ec2: BaseClient, *names: str) -> list[str]:
    reservation = ec2.run_instances(
        ImageId=AMI, InstanceType="p5.48xlarge", MinCount=len(names), MaxCount=len(names)
    )
    ids = [i["InstanceId"] for i in reservation["Instances"]]
    for instance_id, name in zip(ids, names, strict=True):
        ec2.create_tags(Resources=[instance_id], Tags=[{"Key": "Name", "Value": name}])
    return ids


def record_calls(api: BaseClient, operation: str) -> list[dict[str, Any]]:
    """The parameters of every `operation` request the client sends, taken from botocore's own events."""
    calls: list[dict[str, Any]] = []
    service = api.meta.service_model.service_name
    api.meta.events.register(
        f"provide-client-params.{service}.{operation}", lambda params, **_: calls.append(dict(params))
    )
    return calls


def state(ec2: BaseClient, instance_id: str) -> str:
    reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    return reservations[0]["Instances"][0]["State"]["Name"]


class AwsPart:
    """A fake clock whose sleeps also play AWS's part: after sleep n, step n runs (if there is one)."""

    def __init__(self, steps: dict[int, Callable[[], object]] | None = None) -> None:
        self.time = FakeTime()
        self.steps = steps or {}

    def sleep(self, seconds: float) -> None:
        self.time.sleep(seconds)
        step = self.steps.get(len(self.time.sleeps))
        if step is not None:
            step()


def scripted(
    ec2: BaseClient,
    autoscaling: BaseClient | None,
    part: AwsPart,
    ids: dict[str, str] | None = None,
    **kw: Any,
) -> Ec2Provider:
    return Ec2Provider(
        ec2, autoscaling, ids, poll_interval_s=15.0, sleep=part.sleep, clock=part.time.clock, **kw
    )


def down_and_up(ec2: BaseClient, instance_id: str, after: int) -> dict[int, Callable[[], object]]:
    """AWS's part of a reboot, as moto can show it: away after sleep `after`, back one sleep later."""
    return {
        after: lambda: ec2.stop_instances(InstanceIds=[instance_id]),
        after + 1: lambda: ec2.start_instances(InstanceIds=[instance_id]),
    }


def test_reboot_finds_the_node_by_name_tag(ec2: BaseClient, autoscaling: BaseClient) -> None:
    _, b = launch(ec2, "gpu-a", "gpu-b")
    reboots = record_calls(ec2, "RebootInstances")
    part = AwsPart(down_and_up(ec2, b, after=1))
    medic = scripted(ec2, autoscaling, part)
    assert isinstance(medic, NodeProvider)
    assert medic.reboot("gpu-b") == f"EC2 accepted the reboot of gpu-b ({b})"
    assert reboots == [{"InstanceIds": [b]}]
    assert medic.wait_ready("gpu-b", timeout_s=600)


def test_still_running_right_after_a_reboot_is_not_ready(ec2: BaseClient) -> None:
    (a,) = launch(ec2, "gpu-a")
    # Polls 1-3 see it running with both checks ok, as EC2 does right after the request: it never left.
    part = AwsPart(down_and_up(ec2, a, after=3))
    medic = scripted(ec2, None, part)
    medic.reboot("gpu-a")
    assert medic.wait_ready("gpu-a", timeout_s=600)
    assert part.time.sleeps == [15.0] * 4  # ready only at the fifth poll, once it was seen away and back
    # Nothing further requested: no proof owed, and no second wait for the same reboot.
    assert medic.wait_ready("gpu-a", timeout_s=0)


def test_a_reboot_never_seen_going_down_times_out_as_a_permanent_error(ec2: BaseClient) -> None:
    (a,) = launch(ec2, "gpu-a")
    part = AwsPart()
    medic = scripted(ec2, None, part)
    medic.reboot("gpu-a")
    with pytest.raises(NodeNotBackError, match="never seen to go down") as raised:
        medic.wait_ready("gpu-a", timeout_s=600)
    error = raised.value
    assert isinstance(error, PermanentError) and not is_transient(error)  # escalates, never retried
    assert (error.node, error.action, error.waited_s) == ("gpu-a", "reboot", 600)
    assert a in error.before and "InstanceStatus ok" in error.last_seen
    assert str(error).startswith("gpu-a: not confirmed back 600 s after the reboot")


def test_a_node_that_goes_down_and_stays_down_times_out(ec2: BaseClient) -> None:
    (a,) = launch(ec2, "gpu-a")
    part = AwsPart({1: lambda: ec2.stop_instances(InstanceIds=[a])})
    medic = scripted(ec2, None, part)
    medic.reboot("gpu-a")
    with pytest.raises(NodeNotBackError, match=r"went away but was not seen back.*stopped"):
        medic.wait_ready("gpu-a", timeout_s=120)


def test_reset_gpu_reboots_and_says_so(ec2: BaseClient) -> None:
    (a,) = launch(ec2, "gpu-a")
    reboots = record_calls(ec2, "RebootInstances")
    done = provider(ec2, None).reset_gpu("gpu-a", 0)
    assert done.startswith("EC2 has no GPU reset API, so the instance was rebooted to reset GPU 0")
    assert reboots == [{"InstanceIds": [a]}]


def test_discovery_by_private_dns_name(ec2: BaseClient) -> None:
    reservation = ec2.run_instances(ImageId=AMI, MinCount=2, MaxCount=2)  # untagged
    second = reservation["Instances"][1]
    assert provider(ec2, None).instance_id(second["PrivateDnsName"]) == second["InstanceId"]


def test_unknown_and_ambiguous_nodes(ec2: BaseClient) -> None:
    (a,) = launch(ec2, "gpu-a")
    with pytest.raises(UnknownNodeError, match="tag Name=gpu-x"):
        provider(ec2, None).reboot("gpu-x")
    with pytest.raises(UnknownNodeError, match="instance map"):
        provider(ec2, None, {"gpu-a": a}).reboot("gpu-b")
    launch(ec2, "gpu-a")
    with pytest.raises(ProviderError, match="ambiguous"):
        provider(ec2, None).reboot("gpu-a")


def test_plain_instance_is_terminated_and_not_replaced(ec2: BaseClient, autoscaling: BaseClient) -> None:
    (a,) = launch(ec2, "gpu-a")
    sleeps: list[float] = []
    medic = Ec2Provider(ec2, autoscaling, {"gpu-a": a}, sleep=sleeps.append)
    done = medic.replace("gpu-a")
    assert "in no Auto Scaling group, so nothing replaces it" in done
    assert state(ec2, a) in ("shutting-down", "terminated")
    assert not medic.wait_ready("gpu-a", timeout_s=600)  # gone for good: no waiting
    assert sleeps == []


def make_group(ec2: BaseClient, autoscaling: BaseClient, names: tuple[str, ...]) -> dict[str, str]:
    """An Auto Scaling group of len(names) GPU instances, each tagged with its own node name (as a
    launch hook would), returned as name -> instance id."""
    ec2.create_launch_template(
        LaunchTemplateName="gpu", LaunchTemplateData={"ImageId": AMI, "InstanceType": "p5.48xlarge"}
    )
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName="gpus",
        LaunchTemplate={"LaunchTemplateName": "gpu", "Version": "$Latest"},
        MinSize=len(names),
        MaxSize=len(names),
        DesiredCapacity=len(names),
        AvailabilityZones=[f"{REGION}a"],
    )
    group = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=["gpus"])["AutoScalingGroups"][0]
    ids = dict(zip(names, sorted(i["InstanceId"] for i in group["Instances"]), strict=True))
    for name, instance_id in ids.items():
        ec2.create_tags(Resources=[instance_id], Tags=[{"Key": "Name", "Value": name}])
    return ids


def health(autoscaling: BaseClient, instance_id: str) -> str:
    (found,) = autoscaling.describe_auto_scaling_instances(InstanceIds=[instance_id])["AutoScalingInstances"]
    return found["HealthStatus"]


def test_asg_instance_is_marked_unhealthy_and_its_replacement_followed(
    ec2: BaseClient, autoscaling: BaseClient
) -> None:
    ids = make_group(ec2, autoscaling, ("gpu-a", "gpu-b"))
    old = ids["gpu-a"]
    medic = provider(ec2, autoscaling)
    done = medic.replace("gpu-a")
    assert done.startswith(f"marked gpu-a ({old}) Unhealthy in Auto Scaling group gpus")
    assert health(autoscaling, old) == "Unhealthy"
    assert health(autoscaling, ids["gpu-b"]) == "Healthy"
    # The unhealthy old instance is still InService: it must not pass for the node being back.
    with pytest.raises(NodeNotBackError, match=r"gpu-a: not confirmed back .* after the replace"):
        medic.wait_ready("gpu-a", timeout_s=0.2)

    ec2.terminate_instances(InstanceIds=[old])  # AWS's part, which moto leaves out; moto then relaunches

    assert medic.wait_ready("gpu-a", timeout_s=5)
    new = medic.instance_id("gpu-a")
    assert new not in ids.values()
    launched = {
        i["InstanceId"]: i["LaunchTime"]
        for r in ec2.describe_instances(InstanceIds=[old, new])["Reservations"]
        for i in r["Instances"]
    }
    assert launched[new] >= launched[old]
    assert medic.instance_id("gpu-b") == ids["gpu-b"]
    # The replacement carries the node's name, so another process finds it too.
    assert provider(ec2, autoscaling).instance_id("gpu-a") == new


def test_no_unhealthy_mark_when_the_group_would_not_replace(ec2: BaseClient, autoscaling: BaseClient) -> None:
    ids = make_group(ec2, autoscaling, ("gpu-a",))
    autoscaling.suspend_processes(AutoScalingGroupName="gpus", ScalingProcesses=["ReplaceUnhealthy"])
    with pytest.raises(ProviderError, match="ReplaceUnhealthy suspended"):
        provider(ec2, autoscaling).replace("gpu-a")
    assert health(autoscaling, ids["gpu-a"]) == "Healthy"


def test_from_env_uses_the_standard_credential_chain(
    endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "MEDIC_EC2_NAME_TAG": "medic-node",
    }.items():
        monkeypatch.setenv(name, value)
    ec2 = client("ec2", endpoint)
    (a,) = [i["InstanceId"] for i in ec2.run_instances(ImageId=AMI, MinCount=1, MaxCount=1)["Instances"]]
    ec2.create_tags(Resources=[a], Tags=[{"Key": "medic-node", "Value": "gpu-7"}])
    medic = Ec2Provider.from_env(os.environ)
    assert medic.autoscaling is not None
    assert a in medic.reboot("gpu-7")


class Drained:
    """A scheduler that shows every node drained with one reason (only `node` is consulted)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def node(self, name: str) -> NodeInfo:
        return NodeInfo(name=name, state=NodeState.DRAINED, reason=self.reason)


def test_an_instance_held_by_someone_else_is_never_touched(ec2: BaseClient, autoscaling: BaseClient) -> None:
    ids = make_group(ec2, autoscaling, ("gpu-a", "gpu-b", "gpu-c", "gpu-d"))
    (e,) = launch(ec2, "gpu-e")
    ec2.create_tags(Resources=[ids["gpu-a"]], Tags=[{"Key": HOLDER_TAG, "Value": "capacity-team"}])
    autoscaling.enter_standby(
        InstanceIds=[ids["gpu-b"]], AutoScalingGroupName="gpus", ShouldDecrementDesiredCapacity=True
    )
    autoscaling.set_instance_protection(
        InstanceIds=[ids["gpu-c"]], AutoScalingGroupName="gpus", ProtectedFromScaleIn=True
    )
    ec2.stop_instances(InstanceIds=[e])
    sent = [
        *record_calls(ec2, "RebootInstances"),
        *record_calls(ec2, "TerminateInstances"),
        *record_calls(autoscaling, "SetInstanceHealth"),
    ]
    medic = provider(ec2, autoscaling)
    refusals = {
        ("gpu-a", "reboot"): "'capacity-team' \\(tag medic:holder",
        ("gpu-a", "replace"): "capacity-team",
        ("gpu-b", "reboot"): "lifecycle state Standby",
        ("gpu-b", "replace"): "lifecycle state Standby",
        ("gpu-c", "replace"): "protected from scale-in",
        ("gpu-e", "reboot"): "is stopped, not running",
        ("gpu-e", "replace"): "is stopped, not running",
    }
    for (node, action), holder in refusals.items():
        with pytest.raises(NodeHeldError, match=f"{node} is held by .*{holder}.*does not {action} it"):
            getattr(medic, action)(node)
    assert sent == []
    # Scale-in protection guards against termination, not a reboot.
    assert "accepted the reboot" in medic.reboot("gpu-c")
    # Its own holder tag does not stop GPU Medic.
    ec2.create_tags(Resources=[ids["gpu-d"]], Tags=[{"Key": HOLDER_TAG, "Value": "medic: incident 7"}])
    assert "accepted the reboot" in medic.reboot("gpu-d")
    assert health(autoscaling, ids["gpu-a"]) == "Healthy" and state(ec2, e) == "stopped"


def test_a_node_drained_in_the_scheduler_by_someone_else_is_refused(ec2: BaseClient) -> None:
    launch(ec2, "gpu-a")
    reboots = record_calls(ec2, "RebootInstances")
    admin = Ec2Provider(ec2, None, scheduler=Drained("admin: bad fan"))
    with pytest.raises(NodeHeldError, match=r"held by the scheduler \(drained, reason: admin: bad fan\)"):
        admin.reboot("gpu-a")
    assert reboots == []
    ours = Ec2Provider(ec2, None, scheduler=Drained("medic: reboot incident 9"))
    assert "accepted the reboot" in ours.reboot("gpu-a")
    assert len(reboots) == 1


class BootRecord:
    """A scheduler that keeps each node's boot time, as Slurm's BootTime does (only `booted_at` is read)."""

    def __init__(self, booted: dict[str, datetime]) -> None:
        self.booted = booted

    def booted_at(self, name: str) -> datetime | None:
        return self.booted.get(name)


def test_actions_cut_off_by_a_crash_are_settled_from_ec2(
    ec2: BaseClient, autoscaling: BaseClient, sim_backends: Backends, sqlite_store: Store
) -> None:
    """One process claims and calls, then dies; a fresh one (nothing in memory) settles from EC2."""
    make_group(ec2, autoscaling, ("gpu-a", "gpu-b", "gpu-c"))
    launch(ec2, "gpu-e", "gpu-f")
    first = provider(ec2, autoscaling)
    claims = {
        "gpu-a": "replace",  # marked Unhealthy, still InService
        "gpu-b": "replace",  # died before the call
        "gpu-c": "replace",  # Unhealthy, then terminated by its group
        "gpu-e": "replace",  # in no group: terminated
        "gpu-f": "reboot",  # EC2 keeps no trace of a reboot
    }
    for node, action in claims.items():
        sqlite_store.claim_action(f"C1:{node}:{action}", "C1", node, action)
    first.replace("gpu-a")
    old_c = first.instance_id("gpu-c")
    first.replace("gpu-c")
    ec2.terminate_instances(InstanceIds=[old_c])  # AWS's part, which moto leaves out; moto relaunches
    first.replace("gpu-e")
    first.reboot("gpu-f")
    intent = sqlite_store.get_action("C1:gpu-f:reboot")
    assert intent is not None
    later = provider(ec2, autoscaling)
    assert isinstance(later, Reconcilable)

    rt = Runtime(sqlite_store, dataclasses.replace(sim_backends, provider=later), DEFAULT_POLICY)
    settled = dict(line.split(": ", 1) for line in reconcile_intents(rt, {"C1"}))
    assert settled.keys() == {"C1:gpu-a:replace", "C1:gpu-b:replace", "C1:gpu-c:replace", "C1:gpu-e:replace"}
    assert re.fullmatch(
        r"done \(gpu-a \(i-\w+\) running, launched .*, Unhealthy and InService in gpus\)",
        settled["C1:gpu-a:replace"],
    )
    assert settled["C1:gpu-b:replace"].endswith("and still in service: the replacement was never asked for)")
    assert settled["C1:gpu-b:replace"].startswith("not done")
    assert re.fullmatch(
        rf"done \(gpu-c \({old_c}\) (shutting-down|terminated), launched .*\)", settled["C1:gpu-c:replace"]
    )
    assert re.fullmatch(
        r"done \(gpu-e \(i-\w+\) (shutting-down|terminated), launched .*\)", settled["C1:gpu-e:replace"]
    )
    assert [a.key for a in sqlite_store.unfinished_actions()] == ["C1:gpu-f:reboot"]  # stays, escalates

    # Where the scheduler keeps boot times (Slurm's BootTime), it settles the reboot EC2 cannot.
    witnessed = Ec2Provider(
        ec2, autoscaling, scheduler=BootRecord({"gpu-f": intent.intent_at + timedelta(seconds=40)})
    )
    rt = Runtime(sqlite_store, dataclasses.replace(sim_backends, provider=witnessed), DEFAULT_POLICY)
    (line,) = reconcile_intents(rt, {"C1"})
    assert re.fullmatch(r"C1:gpu-f:reboot: done \(gpu-f booted at .*, after the intent\)", line)
    row = sqlite_store.get_action("C1:gpu-f:reboot")
    assert row is not None and row.status == "succeeded"


def test_a_replacement_settled_after_a_crash_is_followed_to_the_new_instance(
    ec2: BaseClient, autoscaling: BaseClient
) -> None:
    """The old instance stays running and InService for a while after it is marked Unhealthy: a fresh
    process must not take it for the node being back."""
    ids = make_group(ec2, autoscaling, ("gpu-a", "gpu-b"))
    since = datetime.now(UTC)
    provider(ec2, autoscaling).replace("gpu-a")  # the process that asked dies here
    later = provider(ec2, autoscaling)
    settled = later.settle("gpu-a", "replace", since)
    assert settled is not None and settled.done
    with pytest.raises(NodeNotBackError, match="after the replace"):
        later.wait_ready("gpu-a", timeout_s=0.2)

    ec2.terminate_instances(InstanceIds=[ids["gpu-a"]])  # AWS's part; moto relaunches

    assert later.wait_ready("gpu-a", timeout_s=5)
    assert later.instance_id("gpu-a") not in ids.values()
