"""`POST /v1/sentry`: Sentry webhooks (shaped like Sentry's documented payloads) to fault events."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import free_port, server_process

from medic.events import EventKind, FaultEvent
from medic.server.app import create_app
from medic.server.sentry import KINDS, translate
from medic.store import Store

FIXTURES = Path(__file__).parent / "fixtures" / "sentry"
SECRET = b"sentry-client-secret"


def body(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes()


def headers(payload: bytes, resource: str, secret: bytes = SECRET) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Request-ID": "e4a6f5b0-2c3d-4e5f-8a9b-0c1d2e3f4a5b",
        "Sentry-Hook-Resource": resource,
        "Sentry-Hook-Timestamp": "1795342543",
        "Sentry-Hook-Signature": hmac.new(secret, payload, hashlib.sha256).hexdigest(),
    }


@asynccontextmanager
async def sentry_client(
    store: Store, accepted: list[FaultEvent] | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    async def hand_on(events: list[FaultEvent]) -> None:
        (accepted if accepted is not None else []).extend(events)

    app = create_app(store, tokens={"t"}, hmac_secret=None, on_accepted=hand_on, sentry_secret=SECRET)
    transport = httpx.ASGITransport(app=app, client=("10.0.0.7", 40000))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://medic") as client,
    ):
        yield client


async def post(client: httpx.AsyncClient, name: str, resource: str, **options: Any) -> httpx.Response:
    payload = options.pop("payload", None) or body(name)
    return await client.post("/v1/sentry", content=payload, headers=headers(payload, resource, **options))


@pytest.mark.anyio
async def test_an_nccl_watchdog_alert_becomes_an_nccl_timeout_on_the_tagged_node(sqlite_store: Store) -> None:
    handed_on: list[FaultEvent] = []
    async with sentry_client(sqlite_store, handed_on) as client:
        response = await post(client, "event_alert_nccl", "event_alert")
    assert (response.status_code, response.json()) == (200, {"accepted": 1, "duplicates": [], "rejected": []})
    (stored,) = sqlite_store.events_between(*_day())
    assert (
        stored.kind,
        stored.node,
        stored.job,
        stored.rank,
        stored.gpu,
        stored.iteration,
        stored.switch,
    ) == (
        EventKind.NCCL_TIMEOUT,
        "gpu-node-12",  # the `node` tag wins over Sentry's server_name
        "48213",
        12,
        4,
        120_400,
        "leaf-3",
    )
    assert stored.id == "sentry-4f6b0e8c3d2a4b1f9e7d6c5b4a392817" and stored.source == "sentry"
    assert stored.attributes["owner"] == "alice"
    assert stored.attributes["sentry_url"].startswith(
        "https://sentry.io/organizations/acme/issues/1117540176/"
    )
    assert [e.id for e in handed_on] == [stored.id]  # on to remediation, like any posted event


@pytest.mark.anyio
async def test_a_cuda_error_naming_its_xid_is_that_xid(sqlite_store: Store) -> None:
    async with sentry_client(sqlite_store) as client:
        response = await post(client, "error_xid", "error")
    assert response.json()["accepted"] == 1
    (stored,) = sqlite_store.events_between(*_day())
    assert (stored.kind, stored.node, stored.attributes["code"], stored.gpu) == (
        EventKind.XID,
        "gpu-node-3",
        79,
        5,
    )


@pytest.mark.anyio
async def test_a_nan_loss_and_a_redelivery(sqlite_store: Store) -> None:
    async with sentry_client(sqlite_store) as client:
        first = await post(client, "event_alert_nan", "event_alert")
        again = await post(client, "event_alert_nan", "event_alert")  # Sentry retries deliveries
    assert first.json()["accepted"] == 1
    assert again.json() == {
        "accepted": 0,
        "duplicates": ["sentry-c0ffee00c0ffee00c0ffee00c0ffee00"],
        "rejected": [],
    }
    (stored,) = sqlite_store.events_between(*_day())
    assert (stored.kind, stored.iteration, stored.rank) == (EventKind.NAN_LOSS, 15_200, 0)


@pytest.mark.anyio
@pytest.mark.parametrize("forged", ["wrong-secret", "missing", "other-body"])
async def test_a_forged_or_missing_signature_stores_nothing(sqlite_store: Store, forged: str) -> None:
    payload = body("event_alert_nccl")
    sent = headers(payload, "event_alert", secret=b"not-the-secret" if forged == "wrong-secret" else SECRET)
    if forged == "missing":
        del sent["Sentry-Hook-Signature"]
    if forged == "other-body":
        payload = payload.replace(b"gpu-node-12", b"gpu-node-13")  # signed, then tampered with
    async with sentry_client(sqlite_store) as client:
        response = await client.post("/v1/sentry", content=payload, headers=sent)
    assert response.status_code == 401 and "Sentry-Hook-Signature" in response.json()["error"]
    assert sqlite_store.events_between(*_day()) == [] and sqlite_store.rejections() == []


@pytest.mark.anyio
async def test_an_exception_that_is_no_fault_is_rejected_and_kept(sqlite_store: Store) -> None:
    async with sentry_client(sqlite_store) as client:
        response = await post(client, "event_alert_unknown", "event_alert")
        no_node = json.loads(body("event_alert_nan"))
        no_node["data"]["event"]["tags"] = [["job", "48299"]]
        nameless = await post(client, "", "event_alert", payload=json.dumps(no_node).encode())
    assert response.status_code == 422
    (problem,) = response.json()["rejected"]
    assert "no fault kind" in problem["error"] and "KeyError" in problem["error"]
    assert nameless.status_code == 422 and "no node" in nameless.json()["rejected"][0]["error"]
    kept = sqlite_store.rejections()
    assert len(kept) == 2 and all(r.origin.startswith("sentry:10.0.0.7:event_alert") for r in kept)
    assert '"0badc0de0badc0de0badc0de0badc0de"' in kept[0].raw  # the webhook as sent, to replay once fixed


@pytest.mark.anyio
async def test_resources_without_an_error_event_are_acknowledged(sqlite_store: Store) -> None:
    async with sentry_client(sqlite_store) as client:
        issue = await post(client, "issue_created", "issue")
    assert issue.status_code == 202 and "issue carries no error event" in issue.json()["ignored"]
    assert sqlite_store.events_between(*_day()) == [] and sqlite_store.rejections() == []


@pytest.mark.anyio
async def test_no_secret_no_endpoint(sqlite_store: Store) -> None:
    app = create_app(sqlite_store, tokens={"t"}, hmac_secret=None, on_accepted=None)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://medic") as client:
        response = await client.post("/v1/sentry", content=body("event_alert_nccl"))
    assert response.status_code == 404


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE", EventKind.XID),
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", EventKind.ECC),
        ("torch.distributed.DistBackendError: NCCL communicator was aborted", EventKind.NCCL_TIMEOUT),
        ("ValueError: Loss is NaN, stopping", EventKind.NAN_LOSS),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", EventKind.JOB_CRASH),
    ],
)
def test_the_kind_table_in_order(text: str, kind: EventKind) -> None:
    assert next(k.kind for k in KINDS if k.pattern.search(text)) is kind
    payload = {
        "data": {
            "event": {"event_id": "e", "exception": {"values": [{"value": text}]}, "tags": [["node", "n1"]]}
        }
    }
    (event,) = translate(json.dumps(payload).encode(), "event_alert", "r").decoded.events
    assert event.kind is kind


def test_medic_serve_takes_sentry_webhooks_when_given_the_secret(tmp_path: Path) -> None:
    port = free_port()
    payload = body("error_xid")
    with server_process(tmp_path / "medic.db", port, {"MEDIC_SENTRY_CLIENT_SECRET": SECRET.decode()}):
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/sentry", content=payload, headers=headers(payload, "error")
        )
    assert (response.status_code, response.json()["accepted"]) == (200, 1)
    store = Store(f"sqlite:///{tmp_path / 'medic.db'}")
    assert [e.id for e in store.events_between(*_day())] == ["sentry-9a1c77b2e0f54d8c8e3b2a1f0c9d8e7f"]
    store.close()


def _day() -> tuple[Any, Any]:
    from datetime import UTC, datetime

    return datetime(2026, 11, 22, tzinfo=UTC), datetime(2026, 11, 23, tzinfo=UTC)
