"""`POST /v1/sentry`: Sentry webhooks (shaped like Sentry's documented payloads) to fault events."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from checkout import TEST_FIXTURES
from fastapi import FastAPI
from test_server import REMOTE, TOKEN, free_port, make_app, samples, server_process, serving

from medic.apps.server.sentry import KINDS, MAX_MATCHED_CHARS, Options, translate
from medic.events import EventKind, FaultEvent
from medic.store import Store

FIXTURES = TEST_FIXTURES / "sentry"
SECRET = b"sentry-client-secret"
DAY = (datetime(2026, 11, 22, tzinfo=UTC), datetime(2026, 11, 23, tzinfo=UTC))


def body(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes()


def edited(name: str, **event: Any) -> bytes:
    """An event_alert fixture with fields of its event replaced (None: removed)."""
    payload = json.loads(body(name))
    inner = payload["data"]["event"]
    for key, value in event.items():
        if value is None:
            del inner[key]
        else:
            inner[key] = value
    return json.dumps(payload).encode()


def headers(
    payload: bytes, resource: str, secret: bytes = SECRET, sent_at: float | None = None
) -> dict[str, str]:
    """The headers Sentry sends (docs.sentry.io, integration platform webhooks): the timestamp is
    Unix seconds when it was sent (getsentry/sentry, app_platform_event.py; SOURCES.md)."""
    return {
        "Content-Type": "application/json",
        "Request-ID": "e4a6f5b0-2c3d-4e5f-8a9b-0c1d2e3f4a5b",
        "Sentry-Hook-Resource": resource,
        "Sentry-Hook-Timestamp": str(int(time.time() if sent_at is None else sent_at)),
        "Sentry-Hook-Signature": hmac.new(secret, payload, hashlib.sha256).hexdigest(),
    }


def sentry_app(
    store: Store, handed_on: list[FaultEvent] | None = None, options: Options | None = None
) -> FastAPI:
    async def hand_on(events: list[FaultEvent]) -> None:
        (handed_on if handed_on is not None else []).extend(events)

    return make_app(store, on_accepted=hand_on, sentry_secret=SECRET, sentry_options=options)


async def post(client: httpx.AsyncClient, payload: bytes | str, resource: str) -> httpx.Response:
    sent = body(payload) if isinstance(payload, str) else payload
    return await client.post("/v1/sentry", content=sent, headers=headers(sent, resource))


@pytest.mark.anyio
async def test_an_nccl_watchdog_alert_becomes_an_nccl_timeout_on_the_tagged_node(sqlite_store: Store) -> None:
    handed_on: list[FaultEvent] = []
    async with serving(sentry_app(sqlite_store, handed_on)) as client:
        response = await post(client, "event_alert_nccl", "event_alert")
    assert (response.status_code, response.json()) == (200, {"accepted": 1, "duplicates": [], "rejected": []})
    (stored,) = sqlite_store.events_between(*DAY)
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
    assert stored.time == datetime(2026, 11, 22, 10, 15, 42, 118000, tzinfo=UTC)
    assert {k: v for k, v in stored.attributes.items() if k != "message"} == {
        "sentry_event": "4f6b0e8c3d2a4b1f9e7d6c5b4a392817",
        "sentry_issue": "1117540176",
        "sentry_title": "DistBackendError: [Rank 12] Watchdog caught collective operation timeout",
        "sentry_url": "https://sentry.io/organizations/acme/issues/1117540176/events/4f6b0e8c3d2a4b1f9e7d6c5b4a392817/",
        "owner": "alice",
    }
    assert [e.id for e in handed_on] == [stored.id]  # on to remediation, like any posted event


@pytest.mark.anyio
async def test_a_cuda_error_naming_its_xid_is_that_xid(sqlite_store: Store) -> None:
    async with serving(sentry_app(sqlite_store)) as client:
        response = await post(client, "error_xid", "error")
    assert response.json()["accepted"] == 1
    (stored,) = sqlite_store.events_between(*DAY)
    assert (stored.kind, stored.node, stored.job, stored.rank, stored.gpu, stored.attributes["code"]) == (
        EventKind.XID,
        "gpu-node-3",  # from the `host` tag
        "48299",
        8,
        5,
        79,
    )


@pytest.mark.anyio
async def test_a_nan_loss_and_a_redelivery(sqlite_store: Store) -> None:
    async with serving(sentry_app(sqlite_store)) as client:
        first = await post(client, "event_alert_nan", "event_alert")
        again = await post(client, "event_alert_nan", "event_alert")  # Sentry delivers it again
        nan = json.loads(body("event_alert_nan"))["data"]["event"]
        as_error = await post(
            client, json.dumps({"action": "created", "data": {"error": nan}}).encode(), "error"
        )
    assert first.json()["accepted"] == 1
    duplicate = {"accepted": 0, "duplicates": ["sentry-c0ffee00c0ffee00c0ffee00c0ffee00"], "rejected": []}
    assert again.json() == duplicate
    assert as_error.json() == duplicate  # the same Sentry event by the `error` resource too
    (stored,) = sqlite_store.events_between(*DAY)
    assert (stored.kind, stored.node, stored.iteration, stored.rank) == (
        EventKind.NAN_LOSS,
        "gpu-node-30",
        15_200,
        0,
    )


@pytest.mark.anyio
@pytest.mark.parametrize("forged", ["wrong-secret", "missing", "other-body", "bearer-token-instead"])
async def test_a_forged_or_missing_signature_stores_nothing(sqlite_store: Store, forged: str) -> None:
    payload = body("event_alert_nccl")
    sent = headers(payload, "event_alert", secret=b"not-the-secret" if forged == "wrong-secret" else SECRET)
    if forged in ("missing", "bearer-token-instead"):
        del sent["Sentry-Hook-Signature"]
    if forged == "bearer-token-instead":
        sent["Authorization"] = f"Bearer {TOKEN}"  # good for /v1/events, not here
    if forged == "other-body":
        payload = payload.replace(b"gpu-node-12", b"gpu-node-13")  # signed, then tampered with
    async with serving(sentry_app(sqlite_store)) as client:
        response = await client.post("/v1/sentry", content=payload, headers=sent)
    assert response.status_code == 401 and "Sentry-Hook-Signature" in response.json()["error"]
    assert sqlite_store.events_between(*DAY) == [] and sqlite_store.rejections() == []


@pytest.mark.anyio
async def test_what_cannot_be_a_fault_is_rejected_and_kept(sqlite_store: Store) -> None:
    no_node = edited("event_alert_nan", tags=[["job", "48299"], ["server_name", ""]])
    cases = [
        # not a GPU fault: dead-lettered only with MEDIC_SENTRY_UNMATCHED=reject
        ("event_alert_unknown", "no fault kind in \"KeyError: 'input_ids'"),
        (no_node, "no node: tag the job's Sentry events with one of node, host"),
        (edited("event_alert_nan", event_id=None), "no event_id"),
        (edited("event_alert_nan", exception="boom"), "not a Sentry event_alert webhook: AttributeError"),
        (b"{not json", "not a Sentry event_alert webhook: JSONDecodeError"),
        (edited("event_alert_nan", datetime="yesterday"), "time: Input should be a valid datetime"),
    ]
    async with serving(sentry_app(sqlite_store, options=Options(reject_unmatched=True))) as client:
        answers = [await post(client, payload, "event_alert") for payload, _ in cases]
    for answer, (_, reason) in zip(answers, cases, strict=True):
        assert answer.status_code == 422
        (problem,) = answer.json()["rejected"]
        assert reason in problem["error"], problem
    assert sqlite_store.events_between(*DAY) == []
    kept = sqlite_store.rejections()
    assert [r.origin for r in kept] == [f"sentry:{REMOTE}:event_alert"] * len(cases)
    assert kept[0].raw == body("event_alert_unknown").decode()  # the webhook as sent, to replay once fixed


@pytest.mark.anyio
async def test_an_unusable_count_tag_is_left_out_not_fatal(sqlite_store: Store) -> None:
    # A job that tags os.environ.get("RANK") outside torchrun sends "None".
    tags = [["node", "gpu-node-30"], ["rank", "None"], ["gpu", "-1"], ["iteration", "15200"]]
    async with serving(sentry_app(sqlite_store)) as client:
        response = await post(client, edited("event_alert_nan", tags=tags), "event_alert")
    assert response.json()["accepted"] == 1
    (stored,) = sqlite_store.events_between(*DAY)
    assert (stored.rank, stored.gpu, stored.iteration) == (None, None, 15_200)


@pytest.mark.anyio
async def test_resources_without_an_error_event_are_acknowledged(sqlite_store: Store) -> None:
    async with serving(sentry_app(sqlite_store)) as client:
        issue = await post(client, "issue_created", "issue")
        unnamed = await client.post("/v1/sentry", content=b"{}", headers=headers(b"{}", ""))
    assert issue.status_code == 202 and "issue carries no error event" in issue.json()["ignored"]
    assert unnamed.status_code == 202 and "(none) carries no error event" in unnamed.json()["ignored"]
    assert sqlite_store.events_between(*DAY) == [] and sqlite_store.rejections() == []


@pytest.mark.anyio
async def test_sentry_webhooks_are_counted_with_the_posted_events(sqlite_store: Store) -> None:
    async with serving(sentry_app(sqlite_store)) as client:
        for name in ("event_alert_nccl", "event_alert_nccl", "event_alert_unknown"):
            await post(client, name, "event_alert")
        await post(client, "issue_created", "issue")
        await client.post("/v1/sentry", content=body("event_alert_nan"), headers={})
        values = samples((await client.get("/metrics")).text)
    assert values[("medic_events_received_total", ())] == 2  # the KeyError is no fault: not an event
    assert values[("medic_events_stored_total", ())] == 1
    assert values[("medic_events_duplicate_total", ())] == 1
    assert values[("medic_events_rejected_total", ())] == 0
    assert values[("medic_sentry_ignored_total", (("reason", "not_a_fault"),))] == 1
    assert values[("medic_sentry_ignored_total", (("reason", "no_error_event"),))] == 1
    answered = {
        code: values[("medic_ingest_seconds_count", (("code", code),))] for code in ("200", "202", "401")
    }
    assert answered == {"200": 2, "202": 2, "401": 1}


@pytest.mark.anyio
async def test_no_secret_no_endpoint(sqlite_store: Store) -> None:
    async with serving(make_app(sqlite_store)) as client:
        response = await post(client, "event_alert_nccl", "event_alert")
    assert response.status_code == 404


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE", EventKind.XID),
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", EventKind.ECC),
        ("torch.distributed.DistBackendError: NCCL communicator was aborted", EventKind.NCCL_TIMEOUT),
        (
            "RuntimeError: Some NCCL operations have failed or timed out. Due to the asynchronous nature "
            "of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.",
            EventKind.NCCL_TIMEOUT,
        ),
        (
            "ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress",
            EventKind.NCCL_TIMEOUT,
        ),
        ("ValueError: Loss is NaN, stopping", EventKind.NAN_LOSS),
        ("AssertionError: loss = inf at step 300", EventKind.NAN_LOSS),
        ("FloatingPointError: Minimum loss scale reached (0.0001).", EventKind.NAN_LOSS),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", EventKind.JOB_CRASH),
        ("RuntimeError: cuDNN error: CUDNN_STATUS_EXECUTION_FAILED", EventKind.JOB_CRASH),
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
    if kind is EventKind.JOB_CRASH:
        assert event.attributes["exit_code"] == -1  # no `exit_code` tag


@pytest.mark.parametrize("text", ["KeyError: 'input_ids'", "OSError: [Errno 28] No space left on device"])
def test_what_the_kind_table_does_not_take(text: str) -> None:
    assert not any(k.pattern.search(text) for k in KINDS)


def test_medic_serve_takes_sentry_webhooks_with_only_the_sentry_secret(tmp_path: Path) -> None:
    port = free_port()
    payload = body("error_xid")
    # No ingest token: /v1/events stays closed, and a secret mounted from a file ends in a newline.
    env = {"MEDIC_INGEST_TOKENS": "", "MEDIC_SENTRY_CLIENT_SECRET": SECRET.decode() + "\n"}
    with server_process(tmp_path / "medic.db", port, env):
        url = f"http://127.0.0.1:{port}"
        response = httpx.post(f"{url}/v1/sentry", content=payload, headers=headers(payload, "error"))
        events = httpx.post(f"{url}/v1/events", content=b"{}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert (response.status_code, response.json()["accepted"]) == (200, 1)
    assert events.status_code == 401
    store = Store(f"sqlite:///{tmp_path / 'medic.db'}")
    assert [e.id for e in store.events_between(*DAY)] == ["sentry-9a1c77b2e0f54d8c8e3b2a1f0c9d8e7f"]
    store.close()


# --- framework NaN messages, exceptions that are no GPU fault, the replay window ---------------

FRAMEWORKS = json.loads((FIXTURES / "frameworks.json").read_text(encoding="utf-8"))


def alert_with(exception_type: str, value: str, event_id: str = "f00dfeed") -> bytes:
    """The NaN event_alert fixture, its exception replaced (a logged message has no type)."""
    exception = {"values": [{"type": exception_type, "value": value} if exception_type else {"value": value}]}
    return edited("event_alert_nan", event_id=event_id, title=value[:100], exception=exception)


@pytest.mark.parametrize("case", FRAMEWORKS, ids=[f"{c['framework']}:{c['value'][:40]}" for c in FRAMEWORKS])
def test_framework_messages_from_their_sources(case: dict[str, Any]) -> None:
    text = f"{case['type']}: {case['value']}" if case["type"] else case["value"]
    found = next((k.kind.value for k in KINDS if k.pattern.search(text)), None)
    assert found == case["kind"], case["source"]
    translated = translate(alert_with(case["type"], case["value"]), "event_alert", "r")
    if case["kind"] is None:
        assert translated.reason == "not_a_fault" and not translated.decoded.rejections
    else:
        (event,) = translated.decoded.events
        assert event.kind == case["kind"]


def test_the_patterns_are_linear_time() -> None:
    for row in KINDS:
        # No unbounded repetition (`*`, `+`, `{n,}`) outside a character class and not escaped,
        # hence no nested unbounded quantifier either.
        bare = re.sub(r"\\.|\[(?:\\.|[^\]])*\]", "", row.pattern.pattern)
        assert not re.search(r"[*+]|\{\d+,\}", bare), row.pattern.pattern
    # Inputs built to make backtracking patterns explode; each is cut to MAX_MATCHED_CHARS.
    nasty = ["xid (" * 20_000, "xid" + " " * 100_000, "nccl " * 30_000, "loss returned in " * 10_000]
    for text in nasty:
        # CPU time, not wall time: a busy machine stretches the wall clock, never a linear match's
        # CPU into the seconds a backtracking one takes.
        started = time.process_time()
        payload = {"data": {"event": {"event_id": "e", "message": text, "tags": [["node", "n"]]}}}
        translate(json.dumps(payload).encode(), "event_alert", "r")
        assert time.process_time() - started < 0.5, text[:20]
    assert MAX_MATCHED_CHARS == 64 * 1024


@pytest.mark.anyio
async def test_an_exception_that_is_no_gpu_fault_is_acknowledged_counted_and_dropped(
    sqlite_store: Store,
) -> None:
    oom = next(c for c in FRAMEWORKS if "out of memory" in c["value"])
    async with serving(sentry_app(sqlite_store)) as client:
        key_error = await post(client, "event_alert_unknown", "event_alert")
        out_of_memory = await post(client, alert_with(oom["type"], oom["value"]), "event_alert")
        values = samples((await client.get("/metrics")).text)
    assert (
        key_error.status_code == 202
        and "no fault kind in \"KeyError: 'input_ids'" in key_error.json()["ignored"]
    )
    assert out_of_memory.status_code == 202 and "CUDA out of memory" in out_of_memory.json()["ignored"]
    assert values[("medic_sentry_ignored_total", (("reason", "not_a_fault"),))] == 2
    assert sqlite_store.events_between(*DAY) == [] and sqlite_store.rejections() == []


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("sent_at", "reason"),
    [
        (-301, "s old, outside the 300 s replay window"),
        # 30 s past the edge: the clock runs on while a loaded machine sends it, closing the gap.
        (+330, "s in the future, outside the 300 s replay window"),
        (None, "Sentry-Hook-Timestamp missing"),
    ],
    ids=["stale", "future", "missing"],
)
async def test_a_delivery_outside_the_replay_window_is_refused(
    sqlite_store: Store, sent_at: int | None, reason: str
) -> None:
    payload = body("event_alert_nccl")
    sent = headers(payload, "event_alert", sent_at=time.time() + (sent_at or 0))
    if sent_at is None:
        del sent["Sentry-Hook-Timestamp"]
    async with serving(sentry_app(sqlite_store)) as client:
        response = await client.post("/v1/sentry", content=payload, headers=sent)
        unchecked = await serving_once(sqlite_store, payload, sent)
    assert response.status_code == 401 and reason in response.json()["error"]
    assert unchecked.status_code == 200  # MEDIC_SENTRY_REPLAY_WINDOW_SECONDS=0: no check
    assert [e.id for e in sqlite_store.events_between(*DAY)] == ["sentry-4f6b0e8c3d2a4b1f9e7d6c5b4a392817"]


async def serving_once(store: Store, payload: bytes, sent: dict[str, str]) -> httpx.Response:
    async with serving(sentry_app(store, options=Options(window_s=0))) as client:
        return await client.post("/v1/sentry", content=payload, headers=sent)


@pytest.mark.anyio
async def test_within_the_window_both_ways_is_accepted(sqlite_store: Store) -> None:
    async with serving(sentry_app(sqlite_store)) as client:
        late = await post_at(client, "event_alert_nccl", time.time() - 290)
        early = await post_at(client, "error_xid", time.time() + 290, "error")
    assert (late.status_code, early.status_code) == (200, 200)


async def post_at(
    client: httpx.AsyncClient, name: str, sent_at: float, resource: str = "event_alert"
) -> httpx.Response:
    payload = body(name)
    return await client.post(
        "/v1/sentry", content=payload, headers=headers(payload, resource, sent_at=sent_at)
    )


def test_the_options_from_the_environment() -> None:
    assert Options.from_env({}) == Options(window_s=300, reject_unmatched=False)
    env = {"MEDIC_SENTRY_REPLAY_WINDOW_SECONDS": "60", "MEDIC_SENTRY_UNMATCHED": "reject"}
    assert Options.from_env(env) == Options(window_s=60, reject_unmatched=True)
    for bad in ({"MEDIC_SENTRY_REPLAY_WINDOW_SECONDS": "5m"}, {"MEDIC_SENTRY_UNMATCHED": "drop"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Options.from_env(bad)
