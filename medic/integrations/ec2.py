"""A `NodeProvider` for plain EC2 GPU instances, optionally in Auto Scaling groups, through boto3.

Node names map to instance ids through an explicit mapping, or by discovery among live instances
(pending, running, stopping, stopped): first by a name tag (`Name` unless configured), then by private
DNS name, full (ip-10-1-2-3.ec2.internal) or short (ip-10-1-2-3, matched with EC2's wildcard filter).
More than one match is an error, never a guess.

`replace` on an instance in an Auto Scaling group marks it Unhealthy so that the group terminates it and
launches a replacement; `wait_ready` then waits for the new InService instance, maps the node to it and,
when the node was found by its name tag, tags the replacement with the same name so that later processes
find it too. An instance in no group is terminated and nothing replaces it. EC2 has no GPU reset API:
`reset_gpu` reboots the instance, which resets every GPU in it, and says so in its result.

A failed AWS call leaves as the `AwsApiError` of its branch (aws_retry.py, aws_errors.py); botocore's
own errors without an AWS answer (a read timeout: the reboot may have happened) stay unknown.

Ownership: before a reboot or replacement the instance must be one nobody else holds (NodeHeldError, no
request sent): state `running` (pending, stopping, stopped, shutting-down are someone else's doing), no
`medic:holder` tag naming anyone but GPU Medic, InService and not already Unhealthy in its Auto Scaling
group (Standby, Pending, Terminating, Detaching, warm pool... are someone else's), for a replacement not
protected from scale-in, and, when a scheduler is given, not out of service there for a reason that is
not GPU Medic's.

Readiness (`wait_ready`) must see the instance go away and come back. EC2 keeps a rebooting instance
`running` with the same LaunchTime, and no API reports a guest's boot time, so after a reboot the proof is
seeing the instance leave readiness (a state other than running, a status check other than ok:
initializing, impaired, insufficient-data, not-applicable) and return to running with both checks ok, or
a LaunchTime later than the one recorded (a stop and start). A reboot that goes down and up between two
polls, or inside one status-check period, is missed: NodeNotBackError at the timeout, the node stays out
and a human looks (never a false "ready"). After a replacement the proof is the new instance: another
instance id, running with both checks ok.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from botocore.client import BaseClient

from medic.integrations.aws_clients import aws_client, node_map
from medic.integrations.aws_errors import AwsApiError
from medic.integrations.aws_retry import Retrier, RetryPolicy, error_code
from medic.integrations.polling import (
    Comeback,
    NodeHeldError,
    NodeNotBackError,
    poll,
    scheduler_holder,
    wait_back,
)
from medic.integrations.provider_errors import ActionRefusedError, AmbiguousNodeError, UnknownNodeError
from medic.integrations.settling import witnessed
from medic.protocols import Scheduler, Settled

log = logging.getLogger(__name__)

NAME_TAG_VAR = "MEDIC_EC2_NAME_TAG"
LIVE_STATES = ["pending", "running", "stopping", "stopped"]
GONE_STATES = {"shutting-down", "terminated"}
ALL_STATES = [*LIVE_STATES, *sorted(GONE_STATES)]
# With any of these suspended, an instance marked Unhealthy is never replaced.
REPLACING_PROCESSES = {"ReplaceUnhealthy", "Launch", "Terminate"}
# A tag another tool (or person) sets to say the instance is theirs for now; GPU Medic's own start "medic".
HOLDER_TAG = "medic:holder"


@dataclass(frozen=True, slots=True)
class PendingReplacement:
    group: str
    old_id: str
    members_before: frozenset[str]


@dataclass(slots=True)
class Requested:
    """A reboot or replacement awaiting proof: the instance and its LaunchTime at the request."""

    comeback: Comeback
    instance_id: str
    launch_time: datetime


class Ec2Provider:
    def __init__(
        self,
        ec2: BaseClient,
        autoscaling: BaseClient | None = None,
        instance_ids: Mapping[str, str] | None = None,
        *,
        name_tag: str = "Name",
        retry: RetryPolicy | None = None,
        poll_interval_s: float = 15.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        scheduler: Scheduler | None = None,
    ) -> None:
        """`instance_ids` maps node names to instance ids; None discovers them (see the module doc).

        Without an `autoscaling` client every instance is treated as one in no group. With a `scheduler`
        a node it shows out of service for someone else's reason is refused (NodeHeldError).
        """
        self.ec2 = ec2
        self.autoscaling = autoscaling
        self.name_tag = name_tag
        self._discover = instance_ids is None
        self._ids: dict[str, str] = dict(instance_ids or {})
        self._named_by_tag: set[str] = set()
        self._pending: dict[str, PendingReplacement] = {}
        self._requested: dict[str, Requested] = {}
        self.scheduler = scheduler
        self._retrier = Retrier(retry or RetryPolicy(), sleep)
        self._poll_interval_s = poll_interval_s
        self._sleep = sleep
        self._clock = clock

    @classmethod
    def from_env(cls, env: Mapping[str, str], scheduler: Scheduler | None = None) -> Ec2Provider:
        """AWS_REGION, MEDIC_EC2_NAME_TAG (default Name), MEDIC_AWS_NODE_MAP (optional, else discovery)."""
        return cls(
            aws_client("ec2", env),
            aws_client("autoscaling", env),
            node_map(env),
            name_tag=env.get(NAME_TAG_VAR) or "Name",
            scheduler=scheduler,
        )

    # NodeProvider

    def reset_gpu(self, node: str, gpu: int | None) -> str:
        done = self.reboot(node)
        which = "its GPUs" if gpu is None else f"GPU {gpu} (with every other GPU on the instance)"
        return f"EC2 has no GPU reset API, so the instance was rebooted to reset {which}: {done}"

    def reboot(self, node: str) -> str:
        instance_id = self.instance_id(node)
        self._ours_to_act_on(node, instance_id, "reboot")
        self._retrier.call(self.ec2.reboot_instances, InstanceIds=[instance_id])
        return f"EC2 accepted the reboot of {node} ({instance_id})"

    def replace(self, node: str) -> str:
        instance_id = self.instance_id(node)
        membership = self._ours_to_act_on(node, instance_id, "replace")
        group = membership["AutoScalingGroupName"] if membership else None
        if group is None:
            self._retrier.call(self.ec2.terminate_instances, InstanceIds=[instance_id])
            return (
                f"terminated {node} ({instance_id}); it is in no Auto Scaling group, so nothing replaces it:"
                " launch a new node yourself"
            )
        described = self._retrier.call(
            self._groups().describe_auto_scaling_groups, AutoScalingGroupNames=[group]
        )
        (details,) = described["AutoScalingGroups"]
        suspended = REPLACING_PROCESSES & {p["ProcessName"] for p in details.get("SuspendedProcesses", [])}
        if suspended:
            raise ActionRefusedError(
                f"{node} ({instance_id}) not marked Unhealthy: Auto Scaling group {group} has"
                f" {', '.join(sorted(suspended))} suspended, so it would not be replaced"
            )
        members = frozenset(i["InstanceId"] for i in details["Instances"])
        self._retrier.call(
            self._groups().set_instance_health,
            InstanceId=instance_id,
            HealthStatus="Unhealthy",
            ShouldRespectGracePeriod=False,
        )
        self._pending[node] = PendingReplacement(group, instance_id, members)
        return (
            f"marked {node} ({instance_id}) Unhealthy in Auto Scaling group {group}; the group terminates it"
            " and launches a replacement"
        )

    def wait_ready(self, node: str, timeout_s: float) -> bool:
        """After a reboot or replacement through this provider: True once the instance was seen to go away
        and come back (module doc), running with both status checks ok; False at once if it is gone for
        good (terminated, nothing replaces it); NodeNotBackError if that was not seen within `timeout_s`.
        A pending replacement is waited for first. With nothing requested here there is nothing to prove:
        True when the instance is ready now, False otherwise."""
        deadline = self._clock() + timeout_s
        requested = self._requested.get(node)
        if node in self._pending and self.wait_replacement(node, timeout_s) is None:
            if requested is None:
                return False
            requested.comeback.last_seen = "no new InService, Healthy instance in its group"
            raise NodeNotBackError(requested.comeback, timeout_s)
        instance_id = self.instance_id(node)
        remaining = max(0.0, deadline - self._clock())
        if requested is None:
            ready = poll(
                lambda: self._readiness(instance_id),
                remaining,
                self._poll_interval_s,
                self._sleep,
                self._clock,
            )
            return ready is True
        back = wait_back(
            requested.comeback,
            lambda c: self._back(c, requested, instance_id),
            remaining,
            self._poll_interval_s,
            self._sleep,
            self._clock,
        )
        if back:
            del self._requested[node]
        return back

    # Settling after a crash

    def settle(self, node: str, action: str, since: datetime) -> Settled | None:
        """What EC2 shows of a request a crash cut off (medic/tasks/nodes/reconcile.py). Any action is done when the
        node's instance launched after the intent; a replacement is settled by the instance that was the
        node (`_settle_replacement`). A reboot leaves nothing in EC2 (same state, same LaunchTime), so
        only the scheduler's boot record can settle it."""
        instance = self._recall(node)
        if instance is None:
            return witnessed(self.scheduler, node, since)
        launched = instance["LaunchTime"]
        seen = (
            f"{node} ({instance['InstanceId']}) {instance['State']['Name']},"
            f" launched {launched:%Y-%m-%d %H:%M:%S%z}"
        )
        if launched > since:
            return Settled(True, f"{seen}, after the intent")
        if action == "replace":
            return self._settle_replacement(node, instance, since, seen)
        return witnessed(self.scheduler, node, since)

    def _settle_replacement(
        self, node: str, instance: dict[str, Any], since: datetime, seen: str
    ) -> Settled | None:
        """Terminated or shutting down, or Unhealthy or terminating in its group: done. Still running,
        InService and Healthy: never done, since both calls take effect before they return. A group still
        replacing it is followed as if this process had asked (`wait_ready` waits for the new instance,
        not the old one that still looks ready)."""
        instance_id, state = instance["InstanceId"], instance["State"]["Name"]
        if state in GONE_STATES:
            return Settled(True, seen)
        membership = self._membership(instance_id)
        if membership is None:
            if state == "running":
                return Settled(False, f"{seen}, and in service: the termination was never asked for")
            return None
        group, health, lifecycle = (
            membership["AutoScalingGroupName"],
            membership["HealthStatus"],
            membership["LifecycleState"],
        )
        if health == "Healthy" and not lifecycle.startswith("Terminating"):
            if state == "running" and lifecycle == "InService":
                return Settled(False, f"{seen}, and still in service: the replacement was never asked for")
            return None
        described = self._retrier.call(
            self._groups().describe_auto_scaling_groups, AutoScalingGroupNames=[group]
        )
        members = [
            i["InstanceId"] for details in described["AutoScalingGroups"] for i in details["Instances"]
        ]
        before = frozenset(
            i["InstanceId"] for i in self._instances(InstanceIds=members) if i["LaunchTime"] <= since
        )
        self._pending[node] = PendingReplacement(group, instance_id, before | {instance_id})
        self._requested[node] = Requested(
            Comeback(node, "replace", seen), instance_id, instance["LaunchTime"]
        )
        return Settled(True, f"{seen}, {health} and {lifecycle} in {group}")

    def _recall(self, node: str) -> dict[str, Any] | None:
        """The instance that is (or was, until terminated) the node; None if that cannot be told."""
        instance_id = self._ids.get(node)
        if instance_id is None and self._discover:
            found = [
                i
                for filter_name, values in (
                    (f"tag:{self.name_tag}", [node]),
                    ("private-dns-name", [node, f"{node}.*"]),
                )
                for i in self._instances(Filters=[{"Name": filter_name, "Values": values}], states=ALL_STATES)
            ]
            live = {i["InstanceId"]: i for i in found if i["State"]["Name"] not in GONE_STATES}
            gone = {i["InstanceId"]: i for i in found if i["InstanceId"] not in live}
            if len(live) > 1 or not (live or gone):
                return None
            # With no live instance left under the name, its latest one is the one the action ended.
            return next(iter(live.values())) if live else max(gone.values(), key=lambda i: i["LaunchTime"])
        if instance_id is None:
            return None
        try:
            (instance,) = self._instances(InstanceIds=[instance_id])
        except AwsApiError as error:
            if error_code(error) != "InvalidInstanceID.NotFound":
                raise
            return None
        return instance

    # Ownership

    def _ours_to_act_on(self, node: str, instance_id: str, action: str) -> dict[str, Any] | None:
        """Refuse (NodeHeldError) an instance someone else holds; otherwise record it as the marker
        `wait_ready` needs and return its Auto Scaling membership (None: in no group)."""
        (instance,) = self._instances(InstanceIds=[instance_id])
        state = instance["State"]["Name"]
        if state != "running":
            raise NodeHeldError(node, f"EC2: {instance_id} is {state}, not running", action)
        tags = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
        holder = tags.get(HOLDER_TAG, "").strip()
        if holder and not holder.startswith("medic"):
            raise NodeHeldError(node, f"{holder!r} (tag {HOLDER_TAG} on {instance_id})", action)
        membership = self._membership(instance_id)
        if membership is not None:
            group = membership["AutoScalingGroupName"]
            lifecycle = membership["LifecycleState"]
            if lifecycle != "InService":
                raise NodeHeldError(node, f"Auto Scaling group {group} (lifecycle state {lifecycle})", action)
            if membership["HealthStatus"] != "Healthy":
                raise NodeHeldError(
                    node,
                    f"Auto Scaling group {group}: already {membership['HealthStatus']}, being replaced",
                    action,
                )
            if action == "replace" and membership.get("ProtectedFromScaleIn"):
                raise NodeHeldError(
                    node,
                    f"Auto Scaling group {group}: protected from scale-in, so not to be terminated",
                    action,
                )
        held = scheduler_holder(self.scheduler, node)
        if held is not None:
            raise NodeHeldError(node, held, action)
        launched = instance["LaunchTime"]
        self._requested[node] = Requested(
            Comeback(node, action, f"{instance_id} running, launched {launched:%Y-%m-%d %H:%M:%S%z}"),
            instance_id,
            launched,
        )
        return membership

    # Replacement

    def wait_replacement(self, node: str, timeout_s: float) -> str | None:
        """The instance id that replaced `node` in its Auto Scaling group (the node maps to it from now
        on), or None if none is InService and Healthy within `timeout_s`."""
        pending = self._pending.get(node)
        if pending is None:
            raise ActionRefusedError(f"no replacement of {node} is pending")
        new_id = poll(
            lambda: self._replacement(pending), timeout_s, self._poll_interval_s, self._sleep, self._clock
        )
        if new_id is None:
            return None
        del self._pending[node]
        self._ids[node] = new_id
        if node in self._named_by_tag:
            self._retrier.call(
                self.ec2.create_tags, Resources=[new_id], Tags=[{"Key": self.name_tag, "Value": node}]
            )
        log.info("%s: %s replaced by %s in %s", node, pending.old_id, new_id, pending.group)
        return new_id

    def _replacement(self, pending: PendingReplacement) -> str | None:
        described = self._retrier.call(
            self._groups().describe_auto_scaling_groups, AutoScalingGroupNames=[pending.group]
        )
        # Several nodes of one group may be replaced at once: skip instances other nodes already claim.
        claimed = pending.members_before | set(self._ids.values())
        fresh = sorted(
            i["InstanceId"]
            for group in described["AutoScalingGroups"]
            for i in group["Instances"]
            if i["LifecycleState"] == "InService"
            and i["HealthStatus"] == "Healthy"
            and i["InstanceId"] not in claimed
        )
        return fresh[0] if fresh else None

    def _groups(self) -> BaseClient:
        """The Auto Scaling client. Only it finds a node's group (`_membership`), so wherever a group, or a
        replacement pending in one, is in hand, there is one."""
        assert self.autoscaling is not None, "an Auto Scaling group was found without an Auto Scaling client"
        return self.autoscaling

    def _membership(self, instance_id: str) -> dict[str, Any] | None:
        if self.autoscaling is None:
            return None
        found = self._retrier.call(
            self.autoscaling.describe_auto_scaling_instances, InstanceIds=[instance_id]
        )["AutoScalingInstances"]
        return dict(found[0]) if found else None

    # Readiness

    def _back(self, comeback: Comeback, requested: Requested, instance_id: str) -> bool | None:
        """True: proven back. False: gone for good. None: not yet (never left, or not back)."""
        (instance,) = self._instances(InstanceIds=[instance_id])
        state = instance["State"]["Name"]
        launched = instance["LaunchTime"]
        checks = self._checks(instance_id) if state == "running" else {}
        comeback.last_seen = f"{instance_id} {state}, launched {launched:%Y-%m-%d %H:%M:%S%z}" + "".join(
            f", {name} {status}" for name, status in checks.items()
        )
        if state in GONE_STATES:
            return False
        if instance_id != requested.instance_id or launched > requested.launch_time:
            comeback.went_away = True  # another instance (replacement), or stopped and started again
        ready = state == "running" and set(checks.values()) == {"ok"}
        if not ready:
            comeback.went_away = True
            return None
        return True if comeback.went_away else None

    def _checks(self, instance_id: str) -> dict[str, str]:
        """The instance's two status checks (ok, initializing, impaired, insufficient-data,
        not-applicable); "none reported" when EC2 lists no status for it."""
        statuses = self._retrier.call(
            self.ec2.describe_instance_status, InstanceIds=[instance_id], IncludeAllInstances=True
        )["InstanceStatuses"]
        if not statuses:
            return {"status checks": "none reported"}
        return {
            check: statuses[0].get(check, {}).get("Status", "none reported")
            for check in ("InstanceStatus", "SystemStatus")
        }

    def _readiness(self, instance_id: str) -> bool | None:
        """True: ready. False: gone for good. None: not yet."""
        (instance,) = self._instances(InstanceIds=[instance_id])
        state = instance["State"]["Name"]
        if state in GONE_STATES:
            return False
        if state != "running":
            return None
        statuses = self._retrier.call(self.ec2.describe_instance_status, InstanceIds=[instance_id])[
            "InstanceStatuses"
        ]
        checks_ok = bool(statuses) and all(
            statuses[0][check]["Status"] == "ok" for check in ("InstanceStatus", "SystemStatus")
        )
        return True if checks_ok else None

    # Names and ids

    def instance_id(self, node: str) -> str:
        if node in self._ids:
            return self._ids[node]
        if not self._discover:
            raise UnknownNodeError(f"{node!r} is not in the configured instance map")
        self._ids[node] = self._find(node)
        return self._ids[node]

    def _find(self, node: str) -> str:
        searches = (
            (f"tag:{self.name_tag}", [node], True),
            ("private-dns-name", [node, f"{node}.*"], False),
        )
        for filter_name, values, by_tag in searches:
            found = [
                i["InstanceId"] for i in self._instances(Filters=[{"Name": filter_name, "Values": values}])
            ]
            if len(found) > 1:
                raise AmbiguousNodeError(
                    f"{node!r} is ambiguous: {filter_name} matches {', '.join(sorted(found))}"
                )
            if found:
                if by_tag:
                    self._named_by_tag.add(node)
                return found[0]
        raise UnknownNodeError(
            f"no live EC2 instance has tag {self.name_tag}={node} or private DNS name {node}"
        )

    def _instances(self, states: list[str] = LIVE_STATES, **request: Any) -> list[dict[str, Any]]:
        if "Filters" in request:
            request["Filters"] = [*request["Filters"], {"Name": "instance-state-name", "Values": states}]
        instances: list[dict[str, Any]] = []
        while True:
            page = self._retrier.call(self.ec2.describe_instances, **request)
            instances += [i for reservation in page["Reservations"] for i in reservation["Instances"]]
            if not page.get("NextToken"):
                return instances
            request["NextToken"] = page["NextToken"]
