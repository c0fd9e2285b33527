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
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from botocore import xform_name
from botocore.client import BaseClient
from botocore.exceptions import BotoCoreError, ClientError

from integrations.aws_clients import aws_client, node_map
from integrations.aws_errors import branch_of, node_action_error, transient
from integrations.aws_retry import Retrier, RetryPolicy, error_code, is_throttling
from integrations.polling import poll
from integrations.provider_errors import InvalidNodeIdError, UnknownNodeError

log = logging.getLogger(__name__)
# Why one node of a batch failed: AWS error code, message, and whether retrying may help.
_Failure = tuple[str, str, bool | None]

CLUSTER_VAR = "MEDIC_HYPERPOD_CLUSTER"
REBOOT = "BatchRebootClusterNodes"
REPLACE = "BatchReplaceClusterNodes"


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
    ) -> None:
        """`node_ids` maps node names to HyperPod node ids; None discovers them with ListClusterNodes."""
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

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> HyperPodProvider:
        """MEDIC_HYPERPOD_CLUSTER (required), AWS_REGION, MEDIC_AWS_NODE_MAP (optional, else discovery)."""
        cluster = env.get(CLUSTER_VAR)
        if not cluster:
            raise ValueError(f"{CLUSTER_VAR} must name the HyperPod cluster (name or ARN)")
        return cls(aws_client("sagemaker", env), cluster, node_map(env))

    # NodeProvider

    def reset_gpu(self, node: str, gpu: int | None) -> str:
        done = self.reboot(node)
        which = "its GPUs" if gpu is None else f"GPU {gpu} (with every other GPU on the node)"
        return f"HyperPod has no GPU reset API, so the node was rebooted to reset {which}: {done}"

    def reboot(self, node: str) -> str:
        return _only(self.batch_reboot([node]), node)

    def replace(self, node: str) -> str:
        return _only(self.batch_replace([node]), node)

    def wait_ready(self, node: str, timeout_s: float) -> bool:
        """True once DescribeClusterNode reports the node Running; False after `timeout_s`.

        After a replace the node has a new instance id. With discovery it is followed as long as the node's
        name survives the replacement (a NodeLogicalId does); with an explicit mapping it cannot be, and
        this returns False at once so the node stays out of service until someone updates the mapping.
        """
        if node in self._retired and not self._discover:
            log.warning("%s was replaced; an explicit node map cannot follow it to its new instance", node)
            return False
        if node not in self._retired:
            self.node_id(node)  # an unknown name fails now, not after the timeout
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
        unique = list(dict.fromkeys(ids.values()))
        limit = self._limits[operation]
        errors: dict[str, _Failure | None] = {}
        for start in range(0, len(unique), limit):
            errors.update(self._send(operation, unique[start : start + limit]))
        outcomes = {}
        for node, node_id in ids.items():
            error = errors[node_id]
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
        ids: dict[str, str] = {}
        request: dict[str, Any] = {"ClusterName": self.cluster_name, "IncludeNodeLogicalIds": True}
        while True:
            page = self._retrier.call(self.client.list_cluster_nodes, **request)
            for summary in page["ClusterNodeSummaries"]:
                for name in _names(summary):
                    ids[name] = summary["InstanceId"]
            if not page.get("NextToken"):
                return ids
            request["NextToken"] = page["NextToken"]

    def _running(self, node: str) -> bool:
        node_id = self._lookup(node)
        if node_id is None:
            return False
        try:
            details = self._retrier.call(
                self.client.describe_cluster_node, ClusterName=self.cluster_name, NodeId=node_id
            )["NodeDetails"]
        except ClientError as error:
            if error_code(error) != "ResourceNotFound":
                raise
            self._ids.pop(node, None)  # gone (replaced or removed): look it up afresh next time
            return False
        status = details.get("InstanceStatus", {})
        log.debug("%s (%s): %s %s", node, node_id, status.get("Status"), status.get("Message", ""))
        return status.get("Status") == "Running"

    def _check_id(self, node_id: str) -> None:
        if not self._id_pattern.fullmatch(node_id):
            raise InvalidNodeIdError(f"{node_id!r} is not a HyperPod node id (i- and 8 or 17 hex digits)")


def _names(summary: Mapping[str, Any]) -> list[str]:
    names = [summary["InstanceId"]]
    if summary.get("NodeLogicalId"):
        names.append(summary["NodeLogicalId"])
    if summary.get("PrivateDnsHostname"):
        names += [summary["PrivateDnsHostname"], summary["PrivateDnsHostname"].split(".", 1)[0]]
    return names


def _only(outcomes: Mapping[str, NodeOutcome], node: str) -> str:
    outcome = outcomes[node]
    if not outcome.ok:
        raise node_action_error(node, outcome.code or "Unknown", outcome.detail, outcome.transient)
    return outcome.detail
