"""botocore's Stubber as SageMaker HyperPod: canned answers in the service model's shapes, for the
provider's adapter tests and for flows that replace a node through it."""

from __future__ import annotations

from datetime import UTC, datetime

from botocore.stub import Stubber

CLUSTER = "train-p5"


def iid(n: int) -> str:
    return f"i-{n:017x}"


def expect_batch(stub: Stubber, op: str, ids: list[str], failed: list[dict[str, str]] | None = None) -> None:
    failed = failed or []
    failed_ids = {f["NodeId"] for f in failed}
    response: dict[str, object] = {"Failed": failed}
    if ok := [i for i in ids if i not in failed_ids]:
        response["Successful"] = ok
    stub.add_response(op, response, {"ClusterName": CLUSTER, "NodeIds": ids})


def expect_throttled(stub: Stubber, op: str, ids: list[str]) -> None:
    stub.add_client_error(
        op,
        service_error_code="ThrottlingException",
        service_message="Rate exceeded",
        http_status_code=400,
        expected_params={"ClusterName": CLUSTER, "NodeIds": ids},
    )


LAUNCHED = datetime(2026, 11, 1, tzinfo=UTC)


def summary(
    instance_id: str, ip: str, logical: str | None = None, status: str = "Running"
) -> dict[str, object]:
    node: dict[str, object] = {
        "InstanceGroupName": "workers",
        "InstanceId": instance_id,
        "InstanceType": "ml.p5.48xlarge",
        "LaunchTime": LAUNCHED,
        "InstanceStatus": {"Status": status},
        "PrivateDnsHostname": f"ip-{ip.replace('.', '-')}.ec2.internal",
    }
    if logical:
        node["NodeLogicalId"] = logical
    return node


def expect_listing(stub: Stubber, pages: list[list[dict[str, object]]]) -> None:
    for number, nodes in enumerate(pages):
        params: dict[str, object] = {"ClusterName": CLUSTER, "IncludeNodeLogicalIds": True}
        if number:
            params["NextToken"] = f"page-{number}"
        response: dict[str, object] = {"ClusterNodeSummaries": nodes}
        if number + 1 < len(pages):
            response["NextToken"] = f"page-{number + 1}"
        stub.add_response("list_cluster_nodes", response, params)


def expect_listed(stub: Stubber, ids: list[str], status: str = "Running") -> None:
    """The ListClusterNodes read a reboot or replacement makes first, to see who holds each node."""
    expect_listing(
        stub, [[summary(i, f"10.1.{n // 250}.{n % 250}", status=status) for n, i in enumerate(ids)]]
    )


def expect_status(stub: Stubber, instance_id: str, status: str, launched: datetime | None = None) -> None:
    details: dict[str, object] = {"InstanceId": instance_id, "InstanceStatus": {"Status": status}}
    if launched is not None:
        details["LaunchTime"] = launched
    stub.add_response(
        "describe_cluster_node", {"NodeDetails": details}, {"ClusterName": CLUSTER, "NodeId": instance_id}
    )
