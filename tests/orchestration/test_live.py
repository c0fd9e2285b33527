"""The live path: `medic serve` stores a POSTed fault and remediates it in process; new evidence
joins the incident being handled; an Approve click in Slack resumes a real paused flow run."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from checkout import REPO_ROOT
from factories import event_dict, fault_event
from fastapi.testclient import TestClient
from prefect.flow_runs import resume_flow_run
from slack_api import SlackApi, running_slack_api
from slack_sdk import WebClient
from waiting import until

from medic.apps.server.app import create_app
from medic.apps.server.slack import SlackCallbacks
from medic.events import FaultEvent
from medic.flows.leases import Leases
from medic.flows.live import LiveDispatcher
from medic.integrations import registry
from medic.integrations.registry import Backends
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.slack.notifier import SlackNotifier
from medic.protocols import NodeState
from medic.store import Store
from medic.store.tables import IncidentRecord
from medic.tasks.runtime.process import Runtime, configure

pytestmark = pytest.mark.usefixtures("prefect_harness")

TOKEN = "ingest-token"
SLACK_TOKEN = "xoxb-test-token"
SIGNING_SECRET = "signing-secret-for-tests"


def event(event_id: str, node: str, kind: str = "xid", **fields: Any) -> FaultEvent:
    """A fault happening now: the live path holds and windows on the wall clock."""
    return fault_event(kind, id=event_id, node=node, at=datetime.now(UTC), **fields)


def posted(event_id: str, node: str) -> dict[str, Any]:
    """An xid 79 happening now, as POSTed."""
    return event_dict(id=event_id, node=node, at=datetime.now(UTC))


def closed(rt: Runtime, node: str) -> Callable[[], IncidentRecord | None]:
    def check() -> IncidentRecord | None:
        found = rt.store.find_incidents(node=node)
        return found[0] if found and found[0].status in ("closed", "escalated") else None

    return check


@pytest.fixture
def client_for(
    runtime: Runtime, live_dispatcher: Callable[..., LiveDispatcher]
) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def build(slack: SlackCallbacks | None = None) -> TestClient:
        app = create_app(
            runtime.store, tokens={TOKEN}, hmac_secret=None, on_accepted=live_dispatcher(runtime), slack=slack
        )
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        return client

    yield build
    for client in clients:
        client.__exit__(None, None, None)


def test_a_posted_fault_is_remediated_in_process(runtime: Runtime, fleet: SimFleet, client_for: Any) -> None:
    client = client_for()
    answer = client.post(
        "/v1/events", json=posted("live-1", "gpu-node-1"), headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert answer.status_code == 200 and answer.json()["accepted"] == 1
    incident = until(closed(runtime, "gpu-node-1"), "the incident to close")
    assert (incident.action, incident.status) == ("reboot", "closed")
    assert fleet.nodes["gpu-node-1"].boots == 1


def test_new_evidence_joins_the_incident_being_handled(
    runtime: Runtime, live_dispatcher: Callable[..., LiveDispatcher]
) -> None:
    dispatcher = live_dispatcher(runtime)
    first = event("join-1", "gpu-node-2", code=48)
    runtime.store.record_accepted([first])
    (incident,) = dispatcher.opener.correlate([first])
    runtime.store.update_incident(incident.id, status="remediating")
    later = event("join-2", "gpu-node-2", code=79)
    runtime.store.record_accepted([later])
    assert dispatcher.opener.correlate([later]) == []  # no second flow run
    assert [e.id for e in runtime.store.incident_events(incident.id)] == ["join-1", "join-2"]


def test_a_switch_storm_is_one_incident_and_touches_no_node(
    store: Store,
    sim_backends: Backends,
    fleet: SimFleet,
    tmp_path: Path,
    live_dispatcher: Callable[..., LiveDispatcher],
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        (REPO_ROOT / "policies" / "default.yaml")
        .read_text()
        .replace("defaults:", "defaults:\n  storm_hold_seconds: 1", 1)
    )
    rt = configure(Runtime(store, sim_backends, policy))
    under_leaf_1 = [n.name for n in fleet.nodes.values() if n.switch == "leaf-1"]
    storm = [
        event(f"storm-{k}-{node}", node, "nccl_timeout", switch="leaf-1", job="llm")
        for k in range(5)
        for node in under_leaf_1
    ]
    dispatcher = live_dispatcher(rt)

    async def arrive() -> None:
        for batch in (storm[:3], storm[3:10], storm[10:]):  # the first node reports alone
            store.record_accepted(batch)
            await dispatcher(batch)
        await dispatcher.drain()

    asyncio.run(arrive())
    (incident,) = store.find_incidents()
    assert (incident.scope, incident.node, incident.status) == ("switch", "leaf-1", "escalated")
    assert (incident.classification, incident.rule) == ("infrastructure", "network-switch-storm")
    assert {e.id for e in store.incident_events(incident.id)} == {e.id for e in storm}
    assert store.action_counts() == {}
    assert all(n.state is NodeState.IDLE and n.boots == 0 for n in fleet.nodes.values())

    # The storm goes on after its incident went to the network team: more evidence, no second run.
    late = event("storm-late", under_leaf_1[0], "nccl_timeout", switch="leaf-1")
    store.record_accepted([late])
    assert dispatcher.opener.correlate([late]) == []
    assert store.incident_events(incident.id)[-1].id == "storm-late"


def slack_click(message_blocks: list[dict[str, Any]], user_id: str, approve: bool) -> bytes:
    action_id = "medic_approve" if approve else "medic_reject"
    button = next(
        b
        for block in message_blocks
        if block["type"] == "actions"
        for b in block["elements"]
        if b.get("action_id") == action_id
    )
    payload = {
        "type": "block_actions",
        "user": {"id": user_id, "username": "alice"},
        "actions": [{"action_id": action_id, "value": button["value"], "type": "button"}],
    }
    return urlencode({"payload": json.dumps(payload)}).encode()


def signed(body: bytes, secret: str = SIGNING_SECRET) -> dict[str, str]:
    timestamp = str(int(time.time()))
    digest = hmac.new(secret.encode(), b"v0:" + timestamp.encode() + b":" + body, hashlib.sha256).hexdigest()
    return {
        "X-Slack-Request-Timestamp": timestamp,
        "X-Slack-Signature": f"v0={digest}",
        "Content-Type": "application/x-www-form-urlencoded",
    }


@pytest.fixture
def slack_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlackApi]:
    monkeypatch.setenv("SLACK_SIGNING_SECRET", SIGNING_SECRET)
    monkeypatch.setenv("MEDIC_APPROVAL_POLL_SECONDS", "1")
    with running_slack_api(SLACK_TOKEN, {"gpu-ops": "C0GPUOPS"}) as api:
        yield api


def test_approve_in_slack_resumes_the_paused_run(
    runtime: Runtime, fleet: SimFleet, client_for: Any, slack_api: SlackApi, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    text = (REPO_ROOT / "policies" / "default.yaml").read_text()
    default = "  required_for: [replace]\n  approvers: []\n  timeout_minutes: 60\n"
    assert default in text  # edit the one approvals block, never add a second (YAML keeps the last)
    policy.write_text(
        text.replace(default, "  required_for: [reboot]\n  approvers: [U0ALICE]\n  timeout_minutes: 5\n")
    )
    runtime.policy_path = policy
    runtime.backends.notifier = SlackNotifier(
        WebClient(token=SLACK_TOKEN, base_url=slack_api.api_url, retry_handlers=[], timeout=5)
    )
    callbacks = SlackCallbacks(
        approvers=lambda: runtime.policy().policy.approvals.approvers,
        resume=resume_flow_run,
        claim=lambda i, approved, by: runtime.store.claim_answer(i, approved=approved, by=by, via="slack"),
        reopen=runtime.store.reopen_approval,
    )
    client = client_for(slack=callbacks)
    client.post(
        "/v1/events", json=posted("live-appr", "gpu-node-3"), headers={"Authorization": f"Bearer {TOKEN}"}
    )

    def approval_message() -> dict[str, Any] | None:
        for request in slack_api.requests:
            blocks = request.params.get("blocks")
            if request.method == "chat.postMessage" and blocks and "medic_approve" in str(blocks):
                return request.params
        return None

    asked = until(approval_message, "the approval request in Slack")
    blocks = json.loads(asked["blocks"]) if isinstance(asked["blocks"], str) else asked["blocks"]
    until(
        lambda: (
            (r := runtime.store.find_incidents(node="gpu-node-3")) and r[0].status == "waiting for approval"
        ),
        "the run to wait for approval",
    )
    time.sleep(1.5)  # the pause is recorded a moment after the status

    body = slack_click(blocks, "U0ALICE", approve=True)
    assert (
        client.post("/v1/slack/interactions", content=body, headers=signed(body, "wrong")).status_code == 401
    )
    outsider = slack_click(blocks, "U0MALLORY", approve=True)
    refused = client.post("/v1/slack/interactions", content=outsider, headers=signed(outsider))
    assert "not an approver" in refused.json()["text"]

    answer = client.post("/v1/slack/interactions", content=body, headers=signed(body))
    assert answer.status_code == 200 and "approved" in answer.json()["text"], answer.text
    incident = until(closed(runtime, "gpu-node-3"), "the approved incident to close")
    assert (incident.action, incident.status) == ("reboot", "closed")
    assert fleet.nodes["gpu-node-3"].boots == 1
    (approval,) = runtime.store.approvals(incident.id)
    assert (approval.approved, approval.by, approval.via) == (True, "U0ALICE", "slack")
    # A Reject clicked a moment later is told the first answer stands.
    late = slack_click(blocks, "U0ALICE", approve=False)
    second = client.post("/v1/slack/interactions", content=late, headers=signed(late))
    assert second.status_code == 200
    assert "was already approved by U0ALICE; your click changed nothing" in second.json()["text"]


def test_a_storm_split_between_two_replicas_is_still_one_switch_incident(
    store: Store, tmp_path: Path, live_dispatcher: Callable[..., LiveDispatcher]
) -> None:
    """A load balancer gives each replica a share of a switch's events. Each share is under the
    storm rule (4 nodes, half the switch): alone, each replica would open node incidents for the
    network's trouble; what the other replica holds is read from the store (BENCHMARKS.md, "At fleet
    scale", burst (c))."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        (REPO_ROOT / "policies" / "default.yaml")
        .read_text()
        .replace("defaults:", "defaults:\n  storm_hold_seconds: 1", 1)
    )
    fleet = SimFleet.build(nodes=16, per_switch=8)
    rt = configure(Runtime(store, registry.simulated(fleet)[0], policy))
    replicas = [live_dispatcher(rt, Leases(store, f"host:replica-{r}:{r}")) for r in range(2)]
    under_leaf_1 = [f"gpu-node-{n}" for n in range(1, 9)]
    shares = [
        [event(f"split-{node}", node, "nccl_timeout", switch="leaf-1", job="llm") for node in nodes]
        for nodes in (under_leaf_1[:3], under_leaf_1[3:6])  # 3 of 8 each: 6 of 8 together
    ]

    async def arrive() -> None:
        for replica, share in zip(replicas, shares, strict=True):
            store.record_accepted(share)
            await replica(share)
        await asyncio.gather(*(replica.drain() for replica in replicas))

    asyncio.run(arrive())
    (incident,) = store.find_incidents()
    assert (incident.scope, incident.node, incident.rule) == ("switch", "leaf-1", "network-switch-storm")
    assert {e.id for e in store.incident_events(incident.id)} == {e.id for share in shares for e in share}
    assert store.action_counts() == {}
