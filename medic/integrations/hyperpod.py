"""A `NodeProvider` for Amazon SageMaker HyperPod clusters, through boto3's SageMaker client.

Node names map to HyperPod node ids (EC2 instance ids) either through an explicit mapping or by discovery
with ListClusterNodes. A discovered node answers to any of: its instance id, its NodeLogicalId (clusters
with continuous provisioning), its private DNS hostname (ip-10-1-2-3.ec2.internal) and that hostname's
first label (ip-10-1-2-3, the node name HyperPod's Slurm uses).

BatchRebootClusterNodes / BatchReplaceClusterNodes take at most 25 ids per call and report failures per
node; the batch methods chunk, validate ids before sending (botocore does not check the id pattern), and
return one outcome per node, marked transient, permanent or unknown (aws_errors.py); `reboot` and
`replace` raise the NodeActionError of that branch. Throttled calls are retried with backoff
(aws_retry.py). HyperPod has no GPU reset API: `reset_gpu` reboots the node, which resets every GPU in
it, and says so in its result.

Ownership: before any request, one ListClusterNodes read gives each node's InstanceStatus. Only a node
that is Running or in Failure is acted on; Pending, ShuttingDown, SystemUpdating,
DeepHealthCheckInProgress (another operation, HyperPod's own or someone's, is acting on it), NotFound or
any status this code does not know is refused with NodeHeldError and never sent; so is a node a given
scheduler shows out of service for someone else's reason.

Readiness: the request records the node's instance id, status and LaunchTime; `wait_ready` answers True
only once DescribeClusterNode has shown the node leave Running (any other status, or not found) or come
back as another instance or with a later LaunchTime, and then Running again. A reboot that HyperPod
completes between two polls without a status change is missed: NodeNotBackError at the timeout, the node
stays out and a human looks (never a false "ready").
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from botocore import xform_name
from botocore.client import BaseClient
from botocore.exceptions import BotoCoreError, ClientError

from medic.integrations.aws_clients import aws_client, node_map
from medic.integrations.aws_errors import branch_of, node_action_error, transient
from medic.integrations.aws_retry import Retrier, RetryPolicy, error_code, is_throttling
from medic.integrations.polling import Comeback, NodeHeldError, poll, scheduler_holder, wait_back
from medic.integrations.provider_errors import InvalidNodeIdError, UnknownNodeError
from medic.integrations.settling import witnessed
from medic.protocols import Scheduler, Settled

log = logging.getLogger(__name__)
# Why one node of a batch failed: AWS error code, message, and whether retrying may help.
_Failure = tuple[str, str, bool | None]

CLUSTER_VAR = "MEDIC_HYPERPOD_CLUSTER"
REBOOT = "BatchRebootClusterNodes"
REPLACE = "BatchReplaceClusterNodes"
# Statuses GPU Medic may act on; any other means another operation has the node, or it is not there.
ACTIONABLE = frozenset({"Running", "Failure"})
HELD = "NodeHeld"  # the code of a node refused before any request because someone else holds it


@dataclass(frozen=True, slots=True)
class NodeOutcome:
    """What the API said about one node of a batch request."""

    node: str
    node_id: str
    ok: bool
    detail: str
    code: str | None = None  # the AWS error code when not ok
    # When not ok: True, trying again may help; False, it cannot; None, unknown (aws_errors.py).
    transient: bool | None = None
    held_by: str | None = None  # refused before any request: who holds the node


@dataclass(frozen=True, slots=True)
class Requested:
    """A reboot or replacement awaiting proof: the node's instance and LaunchTime at the request."""

    comeback: Comeback
    node_id: str
    launch_time: datetime | None


class HyperPodProvider:
    def __init__(
        self,
        client: BaseClient,
        cluster_name: str,
        node_ids: Mapping[str, str] | None = None,
        *,
        retry: RetryPolicy | None = None,
        poll_interval_s: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        scheduler: Scheduler | None = None,
    ) -> None:
        """`node_ids` maps node names to HyperPod node ids; None discovers them with ListClusterNodes.
        With a `scheduler`, a node it shows out of service for someone else's reason is refused."""
        self.client = client
        model = client.meta.service_model
        # Patterns and the batch limit come from the service model botocore ships, so they follow AWS.
        self._id_pattern = re.compile(model.shape_for("ClusterNodeId").metadata["pattern"])
        self._limits = {
            op: model.operation_model(op).input_shape.members["NodeIds"].metadata["max"]
            for op in (REBOOT, REPLACE)
        }
        if not re.fullmatch(model.shape_for("ClusterNameOrArn").metadata["pattern"], cluster_name):
            raise ValueError(f"{cluster_name!r} is not a HyperPod cluster name or ARN")
        self.cluster_name = cluster_name
        self._discover = node_ids is None
        self._ids: dict[str, str] = dict(node_ids or {})
        for node_id in self._ids.values():
            self._check_id(node_id)
        # Ids that replaced nodes had: they no longer stand for the node, whatever a stale listing says.
        self._retired: dict[str, str] = {}
        self._retrier = Retrier(retry or RetryPolicy(), sleep)
        self._poll_interval_s = poll_interval_s
        self._sleep = sleep
        self._clock = clock
        self.scheduler = scheduler
        self._requested: dict[str, Requested] = {}

    @classmethod
    def from_env(cls, env: Mapping[str, str], scheduler: Scheduler | None = None) -> HyperPodProvider:
        """MEDIC_HYPERPOD_CLUSTER (required), AWS_REGION, MEDIC_AWS_NODE_MAP (optional, else discovery)."""
        cluster = env.get(CLUSTER_VAR)
        if not cluster:
            raise ValueError(f"{CLUSTER_VAR} must name the HyperPod cluster (name or ARN)")
        return cls(aws_client("sagemaker", env), cluster, node_map(env), scheduler=scheduler)

    # NodeProvider

    def reset_gpu(self, node: str, gpu: int | None) -> str:
        done = self.reboot(node)
        which = "its GPUs" if gpu is None else f"GPU {gpu} (with every other GPU on the node)"
        return f"HyperPod has no GPU reset API, so the node was rebooted to reset {which}: {done}"

    def reboot(self, node: str) -> str:
        return _only(self.batch_reboot([node]), node, "reboot")

    def replace(self, node: str) -> str:
        return _only(self.batch_replace([node]), node, "replace")

    def wait_ready(self, node: str, timeout_s: float) -> bool:
        """After a reboot or replacement through this provider: True once DescribeClusterNode has shown
        the node go away and come back Running (module doc); NodeNotBackError if that was not seen within
        `timeout_s`. With nothing requested here there is nothing to prove: True once it is Running,
        False after `timeout_s`.

        After a replace the node has a new instance id. With discovery it is followed as long as the node's
        name survives the replacement (a NodeLogicalId does); with an explicit mapping it cannot be, and
        this returns False at once so the node stays out of service until someone updates the mapping.
        """
        if node in self._retired and not self._discover:
            log.warning("%s was replaced; an explicit node map cannot follow it to its new instance", node)
            return False
        if node not in self._retired:
            self.node_id(node)  # an unknown name fails now, not after the timeout
        requested = self._requested.get(node)
        if requested is not None:
            back = wait_back(
                requested.comeback,
                lambda c: self._back(c, requested),
                timeout_s,
                self._poll_interval_s,
                self._sleep,
                self._clock,
            )
            if back:
                del self._requested[node]
            return back
        return bool(
            poll(
                lambda: self._running(node) or None,
                timeout_s,
                self._poll_interval_s,
                self._sleep,
                self._clock,
            )
        )

    # Batches

    def batch_reboot(self, nodes: Iterable[str]) -> dict[str, NodeOutcome]:
        return self._batch(REBOOT, "reboot", nodes)

    def batch_replace(self, nodes: Iterable[str]) -> dict[str, NodeOutcome]:
        outcomes = self._batch(REPLACE, "replacement", nodes)
        for outcome in outcomes.values():
            if outcome.ok:
                self._retired[outcome.node] = outcome.node_id
        return outcomes

    def _batch(self, operation: str, what: str, nodes: Iterable[str]) -> dict[str, NodeOutcome]:
        # Every name resolves and every id validates before the first request: a bad entry stops the
        # whole batch rather than leaving it half done.
        ids = {node: self.node_id(node) for node in nodes}
        for node_id in ids.values():
            self._check_id(node_id)
        action = "replace" if operation == REPLACE else "reboot"
        listed = self._summaries()
        # Two names of one node share its fate: held under either name, it is not sent.
        held: dict[str, str | None] = {}
        for node, node_id in ids.items():
            held[node_id] = held.get(node_id) or self._holder(node, listed.get(node_id))
        unlisted = ("NotListed", "ListClusterNodes does not list this node: nothing was sent", False)
        errors: dict[str, _Failure | None] = {
            node_id: unlisted for node_id in ids.values() if node_id not in listed
        }
        unique = [i for i in dict.fromkeys(ids.values()) if i in listed and held[i] is None]
        limit = self._limits[operation]
        for start in range(0, len(unique), limit):
            errors.update(self._send(operation, unique[start : start + limit]))
        outcomes = {}
        for node, node_id in ids.items():
            holder = held[node_id]
            if holder is not None:
                outcomes[node] = NodeOutcome(
                    node=node,
                    node_id=node_id,
                    ok=False,
                    code=HELD,
                    detail=f"{node} is held by {holder}; GPU Medic does not {action} it (nothing was sent)",
                    transient=False,
                    held_by=holder,
                )
                continue
            error = errors[node_id]
            if error is None:
                self._requested[node] = self._marker(node, action, listed[node_id])
            outcomes[node] = NodeOutcome(
                node=node,
                node_id=node_id,
                ok=error is None,
                code=error[0] if error else None,
                detail=error[1] if error else f"HyperPod accepted the {what} of {node} ({node_id})",
                transient=error[2] if error else None,
            )
        return outcomes

    def _send(self, operation: str, chunk: list[str]) -> dict[str, _Failure | None]:
        """One API call; each id of the chunk maps to None (accepted) or (error code, message, branch)."""
        try:
            response = self._retrier.call(
                getattr(self.client, xform_name(operation)), ClusterName=self.cluster_name, NodeIds=chunk
            )
        except ClientError as error:
            message = error.response.get("Error", {}).get("Message", str(error))
            if is_throttling(error):
                message = f"still throttled after {self._retrier.policy.attempts} attempts: {message}"
            return dict.fromkeys(chunk, (error_code(error), message, branch_of(error)))
        except BotoCoreError as error:  # no usable answer (network, credentials): the outcome is unknown
            name = type(error).__name__  # unless the connection was never made (aws_errors.py)
            return dict.fromkeys(chunk, (name, str(error), transient(name)))
        failed = {
            f["NodeId"]: (f["ErrorCode"], f["Message"], transient(f["ErrorCode"]))
            for f in response.get("Failed", [])
        }
        succeeded = set(response.get("Successful", []))
        unreported = ("NotReported", f"{operation} listed this node neither as done nor as failed", None)
        return {
            node_id: failed.get(node_id, None if node_id in succeeded else unreported) for node_id in chunk
        }

    # Names and ids

    def node_id(self, node: str) -> str:
        node_id = self._lookup(node)
        if node_id is None and node in self._retired:
            raise UnknownNodeError(f"{node!r} was replaced and its new instance is not known (yet)")
        if node_id is None:
            how = "in ListClusterNodes" if self._discover else "in the configured node map"
            raise UnknownNodeError(f"{node!r} is not a node of HyperPod cluster {self.cluster_name} ({how})")
        return node_id

    def _lookup(self, node: str) -> str | None:
        retired = self._retired.get(node)
        node_id = self._ids.get(node)
        if self._discover and node_id in (None, retired):
            self._ids = self._list_nodes()
            node_id = self._ids.get(node)
        if node_id is None or node_id == retired:
            return None
        self._retired.pop(node, None)  # the replacement is known now
        return node_id

    def _list_nodes(self) -> dict[str, str]:
        return {name: node_id for node_id, summary in self._summaries().items() for name in _names(summary)}

    def _summaries(self) -> dict[str, dict[str, Any]]:
        """Every node of the cluster (all pages of ListClusterNodes) by instance id."""
        summaries: dict[str, dict[str, Any]] = {}
        request: dict[str, Any] = {"ClusterName": self.cluster_name, "IncludeNodeLogicalIds": True}
        while True:
            page = self._retrier.call(self.client.list_cluster_nodes, **request)
            for summary in page["ClusterNodeSummaries"]:
                summaries[summary["InstanceId"]] = summary
            if not page.get("NextToken"):
                return summaries
            request["NextToken"] = page["NextToken"]

    # Ownership and readiness

    def _holder(self, node: str, summary: Mapping[str, Any] | None) -> str | None:
        """Who holds the node if not GPU Medic (None: ours to act on; an unlisted node is refused apart)."""
        if summary is None:
            return None
        status = summary.get("InstanceStatus", {}).get("Status")
        if status not in ACTIONABLE:
            return f"HyperPod (status {status}: another operation has the node, or it is not there)"
        return scheduler_holder(self.scheduler, node)

    def _marker(self, node: str, action: str, summary: Mapping[str, Any]) -> Requested:
        return Requested(
            Comeback(node, action, _describe_summary(summary)),
            summary["InstanceId"],
            summary.get("LaunchTime"),
        )

    def _back(self, comeback: Comeback, requested: Requested) -> bool | None:
        """True: seen away and Running again. None: not yet (never left, or not back)."""
        node_id = self._lookup(comeback.node)
        if node_id is None:
            comeback.last_seen = "its new instance is not listed yet"
            return None
        found = self._details(comeback.node, node_id)
        if found is None:
            comeback.went_away = True
            comeback.last_seen = f"{node_id} not found"
            return None
        details = {"InstanceId": node_id, **found}
        comeback.last_seen = _describe_summary(details)
        launched = details.get("LaunchTime")
        if node_id != requested.node_id or (
            launched is not None and requested.launch_time is not None and launched > requested.launch_time
        ):
            comeback.went_away = True  # another instance, or the same one launched again
        if details.get("InstanceStatus", {}).get("Status") != "Running":
            comeback.went_away = True
            return None
        return True if comeback.went_away else None

    def settle(self, node: str, action: str, since: datetime) -> Settled | None:
        """What HyperPod shows of a request a crash cut off (medic/tasks/nodes/reconcile.py): the node launched
        after the intent, or not found after a replacement, or in a status another operation has
        (Pending, ShuttingDown, ...): done. HyperPod's batch calls only queue the work, so a node
        still Running on its old launch proves nothing; the scheduler's boot record may still settle it."""
        node_id = self._lookup(node)
        if node_id is None:
            return witnessed(self.scheduler, node, since)
        details = self._details(node, node_id)
        if details is None:
            if action == "replace":
                return Settled(True, f"{node} ({node_id}) is no longer in cluster {self.cluster_name}")
            return witnessed(self.scheduler, node, since)
        seen = _describe_summary({"InstanceId": node_id, **details})
        launched = details.get("LaunchTime")
        if launched is not None and launched > since:
            return Settled(True, f"{node}: {seen}, after the intent")
        status = details.get("InstanceStatus", {}).get("Status")
        if status not in ACTIONABLE:
            return Settled(True, f"{node}: {seen}, under way in HyperPod")
        return witnessed(self.scheduler, node, since)

    def _running(self, node: str) -> bool:
        node_id = self._lookup(node)
        if node_id is None:
            return False
        details = self._details(node, node_id)
        if details is None:
            return False
        status = details.get("InstanceStatus", {})
        log.debug("%s (%s): %s %s", node, node_id, status.get("Status"), status.get("Message", ""))
        return status.get("Status") == "Running"

    def _details(self, node: str, node_id: str) -> dict[str, Any] | None:
        """DescribeClusterNode's NodeDetails; None when HyperPod no longer has the instance."""
        try:
            details: dict[str, Any] = self._retrier.call(
                self.client.describe_cluster_node, ClusterName=self.cluster_name, NodeId=node_id
            )["NodeDetails"]
        except ClientError as error:
            if error_code(error) != "ResourceNotFound":
                raise
            self._ids.pop(node, None)  # gone (replaced or removed): look it up afresh next time
            return None
        return details

    def _check_id(self, node_id: str) -> None:
        if not self._id_pattern.fullmatch(node_id):
            raise InvalidNodeIdError(f"{node_id!r} is not a HyperPod node id (i- and 8 or 17 hex digits)")


def _describe_summary(summary: Mapping[str, Any]) -> str:
    status = summary.get("InstanceStatus", {})
    message = f" ({status['Message']})" if status.get("Message") else ""
    launched = summary.get("LaunchTime")
    when = f", launched {launched:%Y-%m-%d %H:%M:%S%z}" if launched else ""
    return f"{summary['InstanceId']} {status.get('Status', 'no status')}{message}{when}"


def _names(summary: Mapping[str, Any]) -> list[str]:
    names = [summary["InstanceId"]]
    if summary.get("NodeLogicalId"):
        names.append(summary["NodeLogicalId"])
    if summary.get("PrivateDnsHostname"):
        names += [summary["PrivateDnsHostname"], summary["PrivateDnsHostname"].split(".", 1)[0]]
    return names


def _only(outcomes: Mapping[str, NodeOutcome], node: str, action: str) -> str:
    outcome = outcomes[node]
    if outcome.held_by is not None:
        raise NodeHeldError(node, outcome.held_by, action)
    if not outcome.ok:
        raise node_action_error(node, outcome.code or "Unknown", outcome.detail, outcome.transient)
    return outcome.detail
