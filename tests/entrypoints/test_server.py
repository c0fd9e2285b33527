"""The HTTP ingest service (medic/apps/server): formats, auth, the reply contract, durability, metrics."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from threading import Barrier
from typing import Any

import httpx
import pytest
import typer
from checkout import TEST_FIXTURES
from factories import T0, event_dict, fault_event, incident
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from serve_process import TOKEN, free_port, server_process
from sqlalchemy import create_engine, exc, text, update
from typer.testing import CliRunner

from medic.apps.server import app as server_app
from medic.apps.server.app import MAX_BODY_BYTES, create_app
from medic.apps.server.auth import sign
from medic.apps.server.emit import parse_attribute
from medic.apps.server.main import children_of
from medic.events import FaultEvent
from medic.intake import DEAD_LETTER_SAMPLE, Rejection, RejectionSample
from medic.policy import Decision
from medic.statuses import ACTIVE_INCIDENT_STATUSES, IncidentStatus, StepStatus
from medic.store import Store, utcnow
from medic.store import approvals as approvals_module
from medic.store import rejections as dead_letter_module
from medic.store.engine import unavailable
from medic.store.rejections import DEAD_LETTER_PER_MINUTE, DeadLettered
from medic.store.tables import EventRecord, RejectedRecord

SECRET = b"hmac-secret"
REMOTE = "10.0.0.7"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
NDJSON = {**BEARER, "Content-Type": "application/x-ndjson"}


def ev(event_id: str, kind: str = "xid", **fields: Any) -> dict[str, Any]:
    """What a client POSTs: xid 79 on gpu-017 at T0; not validated, so it can be wrong on purpose."""
    return event_dict(kind, id=event_id, **fields)


def fault(event_id: str, minutes: int = 0) -> FaultEvent:
    return fault_event(id=event_id, minutes=minutes)


def lines(*events: dict[str, Any] | str) -> str:
    return "\n".join(e if isinstance(e, str) else json.dumps(e) for e in events) + "\n"


def stored_ids(store: Store) -> set[str]:
    with store.session() as s:
        return set(s.exec(text("SELECT id FROM events")).scalars())


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running (as under uvicorn), and a client from REMOTE."""
    transport = httpx.ASGITransport(app=app, client=(REMOTE, 40000))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://medic") as client,
    ):
        yield client


def make_app(store: Store, **options: Any) -> FastAPI:
    return create_app(
        store,
        tokens=options.pop("tokens", {TOKEN, "other-token"}),
        hmac_secret=options.pop("hmac_secret", SECRET),
        on_accepted=options.pop("on_accepted", None),
        **options,
    )


# --- input formats ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_single_event_is_committed_before_the_reply(sqlite_store: Store) -> None:
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post("/v1/events", json=ev("e1", gpu=3), headers=BEARER)
        assert response.status_code == 200
        assert response.json() == {"accepted": 1, "duplicates": [], "rejected": []}
        # Read back through a second store on the same file: it is on disk, not in a session.
        other = Store(sqlite_store.url)
        [row] = other.undispatched_events()
        other.close()
    assert (row.id, row.gpu, row.attributes) == ("e1", 3, {"code": 79})


@pytest.mark.anyio
async def test_a_json_array_is_stored_in_one_request(sqlite_store: Store) -> None:
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post("/v1/events", json=[ev(f"e{i}") for i in range(5)], headers=BEARER)
    assert response.json()["accepted"] == 5
    assert stored_ids(sqlite_store) == {f"e{i}" for i in range(5)}


@pytest.mark.anyio
@pytest.mark.parametrize("content_type", ["application/x-ndjson", "application/jsonl", None, "text/plain"])
async def test_json_lines_by_content_type_or_sniffed(sqlite_store: Store, content_type: str | None) -> None:
    # U+2028 is legal inside a JSON string: it must not split a line.
    body = lines(ev("l1"), "", ev("l2", attributes={"code": 79, "message": "a\u2028b"}))
    headers = BEARER | ({"Content-Type": content_type} if content_type else {})
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post("/v1/events", content=body.encode(), headers=headers)
    assert response.json() == {"accepted": 2, "duplicates": [], "rejected": []}
    assert stored_ids(sqlite_store) == {"l1", "l2"}


def cloudevent(event_id: str, kind: str = "medic.fault.xid", **data: Any) -> dict[str, Any]:
    return {
        "specversion": "1.0",
        "type": kind,
        "source": "dcgm-exporter",
        "id": event_id,
        "time": "2025-03-01T12:00:00Z",
        "datacontenttype": "application/json",
        "subject": "ignored",
        "data": {"node": "gpu-042", "gpu": 5, "job": "train-7", "attributes": {"code": 48}} | data,
    }


@pytest.mark.anyio
async def test_cloudevents_structured_batch_and_sniffed(sqlite_store: Store) -> None:
    async with serving(make_app(sqlite_store)) as client:
        single = await client.post(
            "/v1/events",
            content=json.dumps(cloudevent("ce1")),
            headers=BEARER | {"Content-Type": "application/cloudevents+json; charset=utf-8"},
        )
        batch = await client.post(
            "/v1/events",
            content=json.dumps([cloudevent("ce2", "ecc", attributes={"dbe": 1}), cloudevent("ce3")]),
            headers=BEARER | {"Content-Type": "application/cloudevents-batch+json"},
        )
        sniffed = await client.post("/v1/events", json=cloudevent("ce4"), headers=BEARER)
    assert [r.json()["accepted"] for r in (single, batch, sniffed)] == [1, 2, 1]
    events = {e.id: e for e in sqlite_store.undispatched_events()}
    assert events["ce1"].model_dump(mode="json", exclude_none=True) == {
        "id": "ce1",
        "time": "2025-03-01T12:00:00Z",
        "source": "dcgm-exporter",
        "kind": "xid",
        "node": "gpu-042",
        "gpu": 5,
        "job": "train-7",
        "attributes": {"code": 48},
    }
    assert (events["ce2"].kind, events["ce2"].attributes) == ("ecc", {"dbe": 1, "sbe": 0})


@pytest.mark.anyio
async def test_bad_cloudevents_name_the_field_and_keep_what_was_sent(sqlite_store: Store) -> None:
    no_time = cloudevent("ce1")
    del no_time["time"]
    bad = [
        no_time,
        cloudevent("ce2", id="inner"),
        cloudevent("ce3") | {"specversion": "0.3"},
        cloudevent("ce4", attributes={}),
        {"specversion": "1.0", "id": "ce5", "source": "x"},
    ]
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post(
            "/v1/events",
            content=json.dumps(bad),
            headers=BEARER | {"Content-Type": "application/cloudevents-batch+json"},
        )
    assert response.status_code == 422
    assert response.json()["rejected"] == [
        {"index": 0, "error": "time: Field required"},
        {"index": 1, "error": "data.id: set by the CloudEvent's `id` attribute, not in data"},
        {"index": 2, "error": "specversion: only '1.0' is supported, got '0.3'"},
        {"index": 3, "error": "attributes.code: Field required"},
        {"index": 4, "error": "type: Field required (a CloudEvents attribute)"},
    ]
    rejected = sqlite_store.rejections()
    assert json.loads(rejected[3].raw) == bad[3]  # the CloudEvent as sent, not our envelope


CLOUDEVENTS = TEST_FIXTURES / "cloudevents"
# What the spec's examples elide, filled in with ours (tests/fixtures/cloudevents/SOURCES.md).
SPEC_DATA = '"node": "gpu-017", "gpu": 3, "attributes": {"code": 79}'
SPEC_ATTRIBUTES = '"id": "ev-{n}", "source": "/mycontext/subcontext", "time": "2018-04-05T03:56:24Z",'


def spec_request(name: str) -> tuple[dict[str, str], bytes]:
    """One of the HTTP binding's example requests as headers and body, its elisions filled in."""
    head, _, body = (CLOUDEVENTS / f"{name}.http").read_text(encoding="utf-8").partition("\n\n")
    headers = {}
    for line in head.splitlines()[1:]:  # after the request line
        name_, sep, value = line.partition(": ")
        if sep and not line.startswith(" ") and name_.lower() not in ("host", "content-length"):
            headers[name_] = value
    numbered = iter(range(1, 10))
    while "... further attributes omitted ..." in body:
        body = body.replace("... further attributes omitted ...", SPEC_ATTRIBUTES.format(n=next(numbered)), 1)
    body = body.replace("... application data ...", SPEC_DATA)
    body = body.replace("com.example.someotherevent", "medic.fault.xid").replace(
        "com.example.someevent", "medic.fault.xid"
    )
    headers = {k: v.replace("com.example.someevent", "medic.fault.xid") for k, v in headers.items()}
    return headers, body.encode()


@pytest.mark.anyio
async def test_the_http_bindings_examples_in_all_three_modes(sqlite_store: Store) -> None:
    async with serving(make_app(sqlite_store)) as client:
        answers = {}
        for mode in ("binary", "structured", "batched"):
            headers, body = spec_request(f"{mode}_request")
            answers[mode] = await client.post("/v1/events", content=body, headers=BEARER | headers)
    assert {mode: r.json() for mode, r in answers.items()} == {
        "binary": {"accepted": 1, "duplicates": [], "rejected": []},
        "structured": {"accepted": 1, "duplicates": [], "rejected": []},
        "batched": {"accepted": 1, "duplicates": ["ev-1"], "rejected": []},  # ids from our filling-in
    }
    events = {e.id: e for e in sqlite_store.undispatched_events()}
    assert set(events) == {"1234-1234-1234", "ev-1", "ev-2"}
    binary = events["1234-1234-1234"]  # the binary example's ce-id, ce-source, ce-time
    assert binary.model_dump(mode="json", exclude_none=True) == {
        "id": "1234-1234-1234",
        "time": "2018-04-05T03:56:24Z",
        "source": "/mycontext/subcontext",
        "kind": "xid",
        "node": "gpu-017",
        "gpu": 3,
        "attributes": {"code": 79},
    }


def binary(**headers: str | None) -> dict[str, str]:
    """The binding's binary example headers (ours for type), with some replaced or (None) removed."""
    sent, _ = spec_request("binary_request")
    for name, value in headers.items():
        header = name.replace("_", "-")
        sent.pop(header, None)
        if value is not None:
            sent[header] = value
    return BEARER | sent


@pytest.mark.anyio
async def test_a_binary_mode_request_names_the_header_that_is_wrong(sqlite_store: Store) -> None:
    data = json.dumps({"node": "gpu-017", "gpu": 3, "attributes": {"code": 79}})
    cases = [
        (binary(ce_id=None), "ce-id: header missing in binary mode"),
        (binary(ce_source=None), "ce-source: header missing in binary mode"),
        (binary(ce_type=None), "ce-type: header missing in binary mode"),
        (binary(ce_specversion=None), "ce-specversion: header missing in binary mode"),
        (binary(ce_time=None), "ce-time: header missing in binary mode (our events need a time)"),
        (binary(ce_specversion="0.3"), "ce-specversion: only '1.0' is supported, got '0.3'"),
        (binary(ce_source="%C0%A0"), "ce-source: not valid percent-encoded UTF-8"),  # overlong, 3.1.3.2
        (
            binary(ce_datacontenttype="application/json"),
            "ce-datacontenttype: must not be sent in binary mode",
        ),
        (binary(Content_Type="text/plain"), "content-type: binary-mode data must be a JSON object"),
        (binary(ce_time="yesterday"), "time: Input should be a valid datetime"),
    ]
    async with serving(make_app(sqlite_store)) as client:
        answers = [await client.post("/v1/events", content=data, headers=h) for h, _ in cases]
        not_an_object = await client.post("/v1/events", content=b"[1]", headers=binary())
    for answer, (_, reason) in zip(answers, cases, strict=True):
        assert answer.status_code == 422
        (problem,) = answer.json()["rejected"]
        assert problem["index"] == 0 and problem["error"].startswith(reason), problem
    assert not_an_object.json()["rejected"][0]["error"] == "data (the body): expected a JSON object, got list"
    assert sqlite_store.undispatched_events() == []
    kept = sqlite_store.rejections()[0]  # the request as sent: its ce-* headers and its body
    assert "ce-source: /mycontext/subcontext" in kept.raw and kept.raw.endswith(data)
    assert "ce-id" not in kept.raw


@pytest.mark.anyio
async def test_binary_mode_header_values_are_percent_decoded(sqlite_store: Store) -> None:
    data = json.dumps({"node": "gpu-017", "attributes": {"code": 79}})
    # The binding's example (3.1.3.2), lower-case hex and an unnecessary escape, a quoted string.
    source = binary(ce_id="ev%2d1", ce_source="Euro%20%E2%82%AC%20%F0%9F%98%80")
    quoted = binary(ce_id='"ev 2"', ce_source="%e2%82%ac")
    async with serving(make_app(sqlite_store)) as client:
        first = await client.post("/v1/events", content=data, headers=source)
        second = await client.post("/v1/events", content=data, headers=quoted)
    assert (first.json()["accepted"], second.json()["accepted"]) == (1, 1)
    events = {e.id: e.source for e in sqlite_store.undispatched_events()}
    assert events == {"ev-1": "Euro \u20ac \U0001f600", "ev 2": "\u20ac"}


@pytest.mark.anyio
async def test_structured_mode_may_carry_ce_headers_too(sqlite_store: Store) -> None:
    # The binding, 3.2.3: a structured-mode message MAY also carry the binary-mode headers.
    headers = BEARER | {
        "Content-Type": "application/cloudevents+json",
        "ce-id": "other",
        "ce-specversion": "1.0",
    }
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post("/v1/events", content=json.dumps(cloudevent("ce9")), headers=headers)
    assert response.json()["accepted"] == 1
    assert [e.id for e in sqlite_store.undispatched_events()] == ["ce9"]


# --- the reply contract: partial batches, named problems, the dead letter -----------------------


@pytest.mark.anyio
async def test_a_bad_json_line_is_named_its_siblings_stored_and_it_is_dead_lettered(
    sqlite_store: Store,
) -> None:
    body = lines(ev("ok-1"), ev("ok-2"), '{"id": "broken",', ev("ok-3"))
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post("/v1/events", content=body, headers=NDJSON)
    assert response.status_code == 422
    reply = response.json()
    assert reply["accepted"] == 3
    [problem] = reply["rejected"]
    assert problem["line"] == 3 and problem["error"].startswith("not JSON:")
    assert stored_ids(sqlite_store) == {"ok-1", "ok-2", "ok-3"}
    [dead] = sqlite_store.rejections()
    assert (dead.origin, dead.raw) == (f"http:{REMOTE}:3", '{"id": "broken",')


@pytest.mark.anyio
async def test_a_broken_json_document_is_named_by_line(sqlite_store: Store) -> None:
    body = '[\n  {"id": "a"},\n  {"id": "b" "kind": 1}\n]'
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post(
            "/v1/events", content=body, headers=BEARER | {"Content-Type": "application/json"}
        )
    assert response.status_code == 422
    assert response.json() == {
        "accepted": 0,
        "duplicates": [],
        "rejected": [{"line": 3, "error": "not JSON: Expecting ',' delimiter at line 3 column 14"}],
    }
    assert sqlite_store.rejections()[0].raw == body


@pytest.mark.anyio
async def test_an_invalid_field_is_named_with_its_index(sqlite_store: Store) -> None:
    batch = [ev("good"), ev("bad", attributes={"message": "no code"}), ev("worse", gpu=-1), 42]
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post("/v1/events", json=batch, headers=BEARER)
    assert response.status_code == 422
    assert response.json() == {
        "accepted": 1,
        "duplicates": [],
        "rejected": [
            {"index": 1, "error": "attributes.code: Field required"},
            {"index": 2, "error": "gpu: Input should be greater than or equal to 0"},
            {"index": 3, "error": "expected a JSON object, got int"},
        ],
    }
    assert stored_ids(sqlite_store) == {"good"}
    assert [r.origin for r in sqlite_store.rejections()] == [f"http:{REMOTE}:[{i}]" for i in (1, 2, 3)]


@pytest.mark.anyio
async def test_repeated_ids_are_duplicates_not_errors(sqlite_store: Store) -> None:
    async with serving(make_app(sqlite_store)) as client:
        first = await client.post("/v1/events", json=[ev("a"), ev("b"), ev("a")], headers=BEARER)
        again = await client.post("/v1/events", json=[ev("b"), ev("c")], headers=BEARER)
    assert (first.status_code, first.json()) == (200, {"accepted": 2, "duplicates": ["a"], "rejected": []})
    assert (again.status_code, again.json()) == (200, {"accepted": 1, "duplicates": ["b"], "rejected": []})
    assert sqlite_store.count(EventRecord) == 3


@pytest.mark.anyio
async def test_an_empty_body_accepts_nothing(sqlite_store: Store) -> None:
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post("/v1/events", content=b"\n\n", headers=NDJSON)
    assert (response.status_code, response.json()["accepted"]) == (200, 0)


@pytest.mark.anyio
async def test_a_body_over_the_limit_is_refused_unread(sqlite_store: Store) -> None:
    async with serving(make_app(sqlite_store, max_body_bytes=1000)) as client:
        response = await client.post("/v1/events", json=[ev(f"e{i}") for i in range(20)], headers=BEARER)
    assert response.status_code == 413
    assert sqlite_store.count(EventRecord) == 0


# --- a flood of bad items: a sample in the dead letter, every one counted --------------------

JUNK = b"this is junk, not json!!\n"


@pytest.mark.anyio
async def test_16_mb_of_junk_lines_keep_a_sample_answer_briefly_and_the_valid_items_are_stored(
    sqlite_store: Store,
) -> None:
    # The issue's flood: 16 MB of junk lines wrote 645,120 dead-letter rows and a 188 MB answer.
    per_gap = (MAX_BODY_BYTES - 4096) // len(JUNK) // 3
    valid = [ev(f"among-junk-{n}") for n in range(3)]
    body = b"".join(json.dumps(v).encode() + b"\n" + JUNK * per_gap for v in valid)
    junk = 3 * per_gap
    started = time.perf_counter()
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post("/v1/events", content=body, headers=NDJSON)
        values = samples((await client.get("/metrics")).text)
    took = time.perf_counter() - started
    assert response.status_code == 422
    reply = response.json()
    assert reply["accepted"] == 3 and stored_ids(sqlite_store) == {v["id"] for v in valid}
    assert (reply["rejected_total"], reply["dead_lettered"]) == (junk, DEAD_LETTER_SAMPLE)
    assert len(reply["rejected"]) == DEAD_LETTER_SAMPLE
    assert reply["rejected"][0] == {"line": 2, "error": "not JSON: Expecting value at column 1"}
    assert len(response.content) < 16 * 1024
    assert sqlite_store.count(RejectedRecord) == DEAD_LETTER_SAMPLE
    [counted] = sqlite_store.rejection_counts()
    assert (counted.source, counted.reason_class) == (f"http:{REMOTE}", "not JSON")
    assert (counted.rejected, counted.kept) == (junk, DEAD_LETTER_SAMPLE)
    assert values[("medic_events_rejected_total", ())] == junk  # /metrics counts every one
    assert values[("medic_events_received_total", ())] == junk + 3
    assert took < 60, f"{took:.1f} s"  # 77 s before, on 2 cores


@pytest.mark.anyio
async def test_up_to_the_sample_the_answer_is_as_it_always_was(sqlite_store: Store) -> None:
    body = lines(*[f"junk {n}" for n in range(DEAD_LETTER_SAMPLE)], ev("ok"))
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post("/v1/events", content=body, headers=NDJSON)
    assert response.status_code == 422
    assert set(response.json()) == {"accepted", "duplicates", "rejected"}
    assert len(response.json()["rejected"]) == DEAD_LETTER_SAMPLE
    assert sqlite_store.count(RejectedRecord) == DEAD_LETTER_SAMPLE


@pytest.mark.anyio
async def test_the_dead_letter_keeps_at_most_its_rate_per_client_and_counts_the_rest(
    sqlite_store: Store,
) -> None:
    body = lines(*[f"junk {n}" for n in range(DEAD_LETTER_SAMPLE)])
    requests = DEAD_LETTER_PER_MINUTE // DEAD_LETTER_SAMPLE + 1
    async with serving(make_app(sqlite_store)) as client:
        replies = [(await client.post("/v1/events", content=body, headers=NDJSON)) for _ in range(requests)]
    assert {r.status_code for r in replies} == {422}
    assert all(set(r.json()) == {"accepted", "duplicates", "rejected"} for r in replies[:-1])
    last = replies[-1].json()  # the minute's room is spent: its items are listed, counted, not kept
    assert len(last["rejected"]) == last["rejected_total"] == DEAD_LETTER_SAMPLE
    assert last["dead_lettered"] == 0
    assert sqlite_store.count(RejectedRecord) == DEAD_LETTER_PER_MINUTE
    [counted] = sqlite_store.rejection_counts()
    assert (counted.rejected, counted.kept) == (requests * DEAD_LETTER_SAMPLE, DEAD_LETTER_PER_MINUTE)


# --- authentication ----------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer "},
        {"X-Medic-Signature": "sha256=" + "0" * 64},
    ],
    ids=["none", "wrong-token", "wrong-scheme", "empty-token", "bad-signature"],
)
async def test_without_valid_credentials_401_and_nothing_stored(
    sqlite_store: Store, headers: dict[str, str]
) -> None:
    body = json.dumps([ev("e1"), {"not": "an event"}])
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post("/v1/events", content=body, headers=headers)
    assert response.status_code == 401
    assert "error" in response.json()
    assert sqlite_store.count(EventRecord) == 0
    assert sqlite_store.count(RejectedRecord) == 0  # strangers cannot fill the dead letter either


@pytest.mark.anyio
async def test_any_configured_token_is_accepted(sqlite_store: Store) -> None:
    async with serving(make_app(sqlite_store)) as client:
        response = await client.post(
            "/v1/events", json=ev("e1"), headers={"Authorization": "bearer other-token"}
        )
    assert response.status_code == 200


@pytest.mark.anyio
async def test_hmac_signature_of_the_exact_body(sqlite_store: Store) -> None:
    body = json.dumps(ev("signed")).encode()
    async with serving(make_app(sqlite_store)) as client:
        good = await client.post(
            "/v1/events", content=body, headers={"X-Medic-Signature": sign(body, SECRET)}
        )
        tampered = await client.post(
            "/v1/events", content=body + b" ", headers={"X-Medic-Signature": sign(body, SECRET)}
        )
        other_key = await client.post(
            "/v1/events", content=body, headers={"X-Medic-Signature": sign(body, b"guess")}
        )
    assert (good.status_code, tampered.status_code, other_key.status_code) == (200, 401, 401)
    assert stored_ids(sqlite_store) == {"signed"}


@pytest.mark.anyio
async def test_a_signature_is_refused_when_no_secret_is_configured(sqlite_store: Store) -> None:
    body = json.dumps(ev("e1")).encode()
    async with serving(make_app(sqlite_store, hmac_secret=None)) as client:
        response = await client.post(
            "/v1/events", content=body, headers={"X-Medic-Signature": sign(body, b"")}
        )
    assert response.status_code == 401


# --- health and metrics ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_healthz_follows_the_database(tmp_path: Path) -> None:
    database = tmp_path / "medic.db"
    store = Store(f"sqlite:///{database}")
    async with serving(make_app(store)) as client:
        ok = await client.get("/healthz")
        store.engine.dispose()
        for suffix in ("-wal", "-shm"):
            Path(f"{database}{suffix}").unlink(missing_ok=True)
        database.write_bytes(b"this is not a database" * 100)
        down = await client.get("/healthz")
    assert (ok.status_code, ok.json()) == (200, {"status": "ok"})
    assert down.status_code == 503
    # Unauthenticated: it says the store is down, never where the store is.
    assert down.json() == {"status": "unavailable", "error": "the store does not answer (DatabaseError)"}
    assert str(tmp_path) not in down.text
    store.close()


@pytest.mark.anyio
async def test_a_store_that_does_not_answer_is_a_503_with_retry_after_and_acknowledges_nothing(
    tmp_path: Path,
) -> None:
    """Senders (Alertmanager among them) retry a 5xx and drop a 4xx: a store that is down must ask them to
    send again, never a bare 500 (issue 38)."""
    database = tmp_path / "medic.db"
    store = Store(f"sqlite:///{database}")
    app = make_app(store)
    store.engine.dispose()
    database.write_bytes(b"this is not a database" * 100)
    async with serving_raw(app) as client:
        response = await client.post("/v1/events", json=ev("e1"), headers=BEARER)
        values = samples((await client.get("/metrics")).text)
    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert response.json() == {
        "error": "the store does not answer (DatabaseError); nothing was stored: send it again"
    }
    assert str(tmp_path) not in response.text  # where the database is stays in the log
    assert values[("medic_ingest_seconds_count", (("code", "503"),))] == 1
    assert values[("medic_events_stored_total", ())] == 0
    assert values[("medic_store_up", ())] == 0
    assert ("medic_incidents_open", ()) not in values
    store.close()


@pytest.mark.anyio
async def test_a_postgresql_store_gone_is_a_503(postgres_admin_url: str) -> None:
    name = f"medic_gone_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    store = Store(postgres_admin_url.rsplit("/", 1)[0] + f"/{name}")
    app = make_app(store)
    store.engine.dispose()
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    admin.dispose()
    async with serving_raw(app) as client:
        response = await client.post("/v1/events", json=ev("e1"), headers=BEARER)
    assert response.status_code == 503 and response.headers["Retry-After"] == "5", response.text
    assert response.json()["error"].startswith("the store does not answer (OperationalError)")
    store.close()


@asynccontextmanager
async def serving_raw(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client for an app whose store is gone: no lifespan (it reads the store), a 500 answered, not raised."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://medic") as client:
        yield client


def samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


@pytest.mark.anyio
async def test_metrics_count_requests_and_read_the_store(sqlite_store: Store) -> None:
    sqlite_store.open_incident(incident(fault("x1"), id="inc-open", node="gpu-001"))
    sqlite_store.open_incident(incident(fault("x2"), id="inc-done", node="gpu-002"))
    sqlite_store.update_incident("inc-done", status="closed", closed_at=T0)
    for key, action, status in [
        ("k1", "reboot", "succeeded"),
        ("k2", "reboot", "succeeded"),
        ("k3", "drain", "failed"),
    ]:
        sqlite_store.claim_action(key, "inc-open", "gpu-001", action)
        sqlite_store.finish_action(key, status)
    sqlite_store.claim_action("k4", "inc-open", "gpu-001", "reboot")
    async with serving(make_app(sqlite_store)) as client:
        await client.post(
            "/v1/events", json=[ev("a"), ev("b"), ev("a"), ev("bad", attributes={})], headers=BEARER
        )
        await client.post("/v1/events", content=lines(ev("c"), "nope"), headers=NDJSON)
        await client.post("/v1/events", json=ev("d"), headers={})
        response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")  # what Prometheus 2 reads
    values = samples(response.text)
    assert values[("medic_events_received_total", ())] == 6
    assert values[("medic_events_stored_total", ())] == 3
    assert values[("medic_events_duplicate_total", ())] == 1
    assert values[("medic_events_rejected_total", ())] == 2
    assert values[("medic_store_up", ())] == 1
    assert values[("medic_incidents_open", ())] == 1
    actions = {labels: v for (name, labels), v in values.items() if name == "medic_actions_total"}
    assert actions == {
        (("action", "drain"), ("status", "failed")): 1,
        (("action", "reboot"), ("status", "intent")): 1,
        (("action", "reboot"), ("status", "succeeded")): 2,
    }
    assert values[("medic_ingest_seconds_count", (("code", "422"),))] == 2
    assert values[("medic_ingest_seconds_count", (("code", "401"),))] == 1
    dead_letter = {
        (name, labels): v for (name, labels), v in values.items() if name.startswith("medic_dead_letter_")
    }
    assert sum(v for (name, _), v in dead_letter.items() if name == "medic_dead_letter_rejected_total") == 2
    assert sum(v for (name, _), v in dead_letter.items() if name == "medic_dead_letter_kept_total") == 2
    # gpu-001's last successful action of ours took it out, and nothing of ours returned it: held.
    held = {labels: v for (name, labels), v in values.items() if name == "medic_node_held_seconds"}
    assert list(held) == [
        (("action", "reboot"), ("incident", "inc-open"), ("incident_status", "open"), ("node", "gpu-001"))
    ]
    assert 0 <= next(iter(held.values())) < 60


@pytest.mark.anyio
async def test_each_app_has_its_own_registry(tmp_path: Path) -> None:
    first, second = (Store(f"sqlite:///{tmp_path / f'{n}.db'}") for n in ("one", "two"))
    async with serving(make_app(first)) as one, serving(make_app(second)) as two:
        await one.post("/v1/events", json=ev("a"), headers=BEARER)
        other = samples((await two.get("/metrics")).text)
    assert other[("medic_events_received_total", ())] == 0
    first.close()
    second.close()


@pytest.mark.anyio
async def test_metrics_in_openmetrics_when_asked(sqlite_store: Store) -> None:
    async with serving(make_app(sqlite_store)) as client:
        response = await client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")


# --- handing accepted events on --------------------------------------------------------------


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_app, "HAND_ON_RETRY_S", (0.01, 0.01, 0.01))


@pytest.mark.anyio
async def test_a_failed_hand_on_is_tried_again_before_the_next_batch(
    sqlite_store: Store, quick_retries: None
) -> None:
    handed: list[list[str]] = []

    async def on_accepted(events: list[FaultEvent]) -> None:
        handed.append([e.id for e in events])
        if len(handed) == 1:
            raise RuntimeError("the store's pool timed out")
        sqlite_store.attach_events([incident(*events, id=f"inc-{events[0].id}", node="gpu-017")])

    async with serving(make_app(sqlite_store, on_accepted=on_accepted)) as client:
        await client.post("/v1/events", json=[ev("a"), ev("b")], headers=BEARER)
        await client.post("/v1/events", json=[ev("a")], headers=BEARER)  # nothing new: nothing handed on
        await client.post("/v1/events", content=lines(ev("c"), "junk"), headers=NDJSON)
    # Leaving the lifespan waits until everything queued was handed on.
    assert handed == [["a", "b"], ["a", "b"], ["c"]]
    assert sqlite_store.undispatched_events() == []  # nothing waits for a restart


@pytest.mark.anyio
async def test_a_batch_the_hook_never_takes_stays_stored_and_the_next_goes_on(
    sqlite_store: Store, quick_retries: None
) -> None:
    handed: list[list[str]] = []

    async def on_accepted(events: list[FaultEvent]) -> None:
        handed.append([e.id for e in events])
        if "a" in handed[-1]:
            raise RuntimeError("the dispatcher fell over")

    async with serving(make_app(sqlite_store, on_accepted=on_accepted)) as client:
        await client.post("/v1/events", json=[ev("a"), ev("b")], headers=BEARER)
        await client.post("/v1/events", json=[ev("c")], headers=BEARER)
    assert handed == [["a", "b"]] * (len(server_app.HAND_ON_RETRY_S) + 1) + [["c"]]
    # A failed hand-on loses nothing: the events stay stored, for the next start's backlog.
    assert {e.id for e in sqlite_store.undispatched_events()} == {"a", "b", "c"}


@pytest.mark.anyio
async def test_events_never_handed_on_are_handed_on_at_the_next_start(sqlite_store: Store) -> None:
    sqlite_store.record_accepted([fault("before-crash")])
    handed: list[list[str]] = []

    async def on_accepted(events: list[FaultEvent]) -> None:
        handed.append([e.id for e in events])
        sqlite_store.attach_events([incident(*events, id="inc-1", node="gpu-017")])

    async with serving(make_app(sqlite_store, on_accepted=on_accepted)):
        pass
    async with serving(make_app(sqlite_store, on_accepted=on_accepted)):
        pass  # attached to an incident now: not handed on again
    assert handed == [["before-crash"]]


# --- the store methods the server relies on (SQLite and PostgreSQL) ---------------------------


def test_record_accepted_stores_each_id_once(store: Store) -> None:
    first = store.record_accepted([fault("a"), fault("b"), fault("a")])
    assert [e.id for e in first] == ["a", "b"]
    assert [e.id for e in store.record_accepted([fault("b"), fault("c")])] == ["c"]
    assert store.count(EventRecord) == 3


def test_record_accepted_racing_writers_store_each_id_once(store: Store) -> None:
    events = [fault(f"e{i}") for i in range(50)]
    barrier = Barrier(4)

    def write(_: int) -> list[str]:
        barrier.wait()
        return [e.id for e in store.record_accepted(events)]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(write, range(4)))
    assert sorted(i for r in results for i in r) == sorted(e.id for e in events)
    assert store.count(EventRecord) == 50


def junk_sample(source: str, count: int) -> RejectionSample:
    return RejectionSample.of(Rejection(f"{source}:{n}", f"junk {n}", "not JSON: x") for n in range(count))


def test_the_dead_letter_rate_is_per_source_and_per_minute(store: Store) -> None:
    assert store.dead_letter(junk_sample("a_b.jsonl", 5), per_minute=8) == DeadLettered(5, 5)
    assert store.dead_letter(junk_sample("a_b.jsonl", 5), per_minute=8) == DeadLettered(5, 3)
    # Another source has room of its own, one whose name only looks alike (`_` is LIKE's wildcard) too.
    assert store.dead_letter(junk_sample("axb.jsonl", 5), per_minute=8) == DeadLettered(5, 5)
    with store.session() as s:
        s.exec(update(RejectedRecord).values(received_at=utcnow() - timedelta(seconds=61)))
        s.commit()
    assert store.dead_letter(junk_sample("a_b.jsonl", 5), per_minute=8) == DeadLettered(
        5, 5
    )  # a minute later
    counts = {(c.source, c.reason_class): (c.rejected, c.kept) for c in store.rejection_counts()}
    assert counts == {("a_b.jsonl", "not JSON"): (15, 13), ("axb.jsonl", "not JSON"): (5, 5)}
    assert all(c.first_seen <= c.last_seen for c in store.rejection_counts())


def test_record_rejections_keeps_a_sample_of_a_file_and_counts_all(store: Store) -> None:
    assert store.record_rejections(junk_sample("big.jsonl", 250).kept) == DEAD_LETTER_SAMPLE
    flood = [Rejection(f"big.jsonl:{n}", "junk", "not JSON: x") for n in range(250)]
    assert store.record_rejections(flood) == 250  # what `medic ingest` reports
    assert store.count(RejectedRecord) == 2 * DEAD_LETTER_SAMPLE
    [counted] = store.rejection_counts()
    assert (counted.rejected, counted.kept) == (DEAD_LETTER_SAMPLE + 250, 2 * DEAD_LETTER_SAMPLE)


def test_racing_writers_count_every_rejection(store: Store) -> None:
    barrier = Barrier(4)

    def write(_: int) -> DeadLettered:
        barrier.wait()
        return store.dead_letter(junk_sample("race.jsonl", 30))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(write, range(4)))
    [counted] = store.rejection_counts()
    assert counted.rejected == 120
    assert counted.kept == sum(r.kept for r in results) == store.count(RejectedRecord) == 120


def test_the_dead_letter_counts_on_a_database_without_upserts(
    sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dead_letter_module, "_upsert", lambda _dialect: None)
    for _ in range(2):
        sqlite_store.dead_letter(junk_sample("f", 3))
    [counted] = sqlite_store.rejection_counts()
    assert (counted.source, counted.rejected, counted.kept) == ("f", 6, 6)


def test_attach_events_and_what_is_left_undispatched(store: Store) -> None:
    history = fault_event("remediation", id="h", action="reboot")
    store.record_accepted([fault("x2", 2), fault("x1", 1), history, fault("y", 3)])
    assert [e.id for e in store.undispatched_events()] == ["x1", "x2", "y"]  # oldest first, no history
    assert store.attach_events([incident(fault("x1"), fault("x2"), id="inc-x")]) == 2
    assert store.attach_events([incident(fault("x1"), id="inc-other")]) == 0  # never moved
    assert [e.id for e in store.incident_events("inc-x")] == ["x1", "x2"]
    assert [e.id for e in store.undispatched_events()] == ["y"]


def test_a_jobs_live_reports_are_not_handed_on_again_at_a_start(store: Store) -> None:
    """Step timings, stall and profile reports are read as they come and held by no incident: a start
    would read back every one a job ever sent (millions in a day) and feed stale ones to the detector."""
    job = {"job": "train-1", "rank": 3}
    store.record_accepted(
        [
            fault_event(
                "health_check",
                id="timings",
                attributes={"check": "step_timings", "steps": [10, 11], "seconds": [0.5, 0.5]},
                **job,
            ),
            fault_event("health_check", id="stall", check="stall", minutes=1, **job),
            fault_event("health_check", id="profile", check="profile", minutes=2, **job),
            fault_event(
                "health_check", id="dcgm", minutes=3, attributes={"check": "dcgm_l1", "passed": False}
            ),
            fault_event("health_check", id="unnamed", minutes=4, attributes={"passed": False}),
            fault("xid", 5),
        ]
    )
    assert [e.id for e in store.undispatched_events()] == ["dcgm", "unnamed", "xid"]


def test_events_absorbed_as_evidence_are_marked_once_and_not_handed_on_again(store: Store) -> None:
    store.record_accepted([fault("victim", 1), fault("timeout", 2), fault("culprit", 3), fault("held", 4)])
    store.attach_events([incident(fault("culprit"), id="inc-culprit")])
    pairs = [
        ("victim", "culprit"),
        ("timeout", "culprit"),
        ("culprit", "victim"),
    ]  # the last is in an incident
    assert store.mark_explained(pairs) == 2
    assert store.mark_explained([("victim", "held")]) == 0  # explained once, by what explained it first
    assert store.mark_explained([]) == 0
    assert [e.id for e in store.undispatched_events()] == ["held"]
    assert store.verify_chain().ok  # the marks are audited like every write to an event


def test_ping_and_the_counts_for_metrics(store: Store) -> None:
    store.ping()
    assert store.open_incident_count() == 0 and store.action_counts() == {}
    store.open_incident(incident(fault("a"), id="inc-1"))
    store.claim_action("k", "inc-1", "gpu-017", "reboot")
    assert store.open_incident_count() == 1
    assert store.action_counts() == {("reboot", "intent"): 1}


def test_decision_delays_run_from_first_arrival_to_first_decision(store: Store) -> None:
    decided = incident(fault("d1"), fault("d2", 1), id="inc-d")
    store.record_events([decided], received_at=utcnow() - timedelta(seconds=3))
    store.open_incident(decided)
    pending = incident(fault("p1"), id="inc-p", node="gpu-018")
    store.record_events([pending])
    store.open_incident(pending)  # no decision yet: not counted
    for rule in ("first", "second"):
        store.add_decision(
            Decision(incident="inc-d", classification="hardware", action="reboot", rule=rule, reason="-"),
            "p.yaml",
        )
    ((delay),) = store.decision_delays()
    assert 3 <= delay < 60


@pytest.mark.anyio
async def test_metrics_histogram_of_decision_delays(sqlite_store: Store) -> None:
    slow = incident(fault("s1"), id="inc-slow", node="gpu-001")
    sqlite_store.record_events([slow], received_at=utcnow() - timedelta(seconds=40))
    sqlite_store.open_incident(slow)
    sqlite_store.add_decision(
        Decision(incident="inc-slow", classification="hardware", action="drain", rule="r", reason="-"),
        "p.yaml",
    )
    async with serving(make_app(sqlite_store)) as client:
        values = samples((await client.get("/metrics")).text)
    buckets = {
        dict(labels)["le"]: v
        for (name, labels), v in values.items()
        if name == "medic_decision_seconds_bucket"
    }
    assert (buckets["30.0"], buckets["60.0"], buckets["+Inf"]) == (0, 1, 1)
    assert values[("medic_decision_seconds_count", ())] == 1
    assert 40 <= values[("medic_decision_seconds_sum", ())] < 100


@pytest.mark.anyio
async def test_metrics_say_the_breaker_the_guardrails_blocks_and_the_time_to_contain(
    sqlite_store: Store,
) -> None:
    """The figures deployments/prometheus/gpu-medic.rules.yml alerts on: breaker open, guardrail blocks,
    time to contain."""
    async with serving(make_app(sqlite_store)) as client:
        before = samples((await client.get("/metrics")).text)
    assert before[("medic_breaker_open", ())] == 0
    assert before[("medic_contain_seconds_count", ())] == 0

    contained = incident(fault("c1"), id="inc-c", node="gpu-001")
    sqlite_store.record_events([contained], received_at=utcnow() - timedelta(seconds=2))
    sqlite_store.open_incident(contained)
    sqlite_store.add_step("inc-c", "contain", utcnow(), StepStatus.OK, "drained gpu-001")
    for n in (1, 2):  # two decisions of one incident stopped by one guardrail: one incident blocked
        blocked = Decision(
            incident="inc-c",
            classification="hardware",
            action="escalate",
            rule=f"r{n}",
            reason="-",
            guardrail="circuit_breaker",
            blocked_action="reboot",
        )
        sqlite_store.add_decision(blocked, "p.yaml")
    sqlite_store.open_breaker("3 nodes taken out within 5 minutes", incident_id="inc-c")
    async with serving(make_app(sqlite_store)) as client:
        after = samples((await client.get("/metrics")).text)
    assert after[("medic_breaker_open", ())] == 1
    assert after[("medic_guardrail_blocks_total", (("guardrail", "circuit_breaker"),))] == 1
    assert after[("medic_contain_seconds_count", ())] == 1
    assert 2 <= after[("medic_contain_seconds_sum", ())] < 60


@pytest.mark.anyio
async def test_metrics_say_how_many_approvals_wait_and_for_how_long(
    sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What GPUMedicApprovalWaiting alerts on: unanswered requests of incidents still waiting on them."""
    async with serving(make_app(sqlite_store)) as client:
        before = samples((await client.get("/metrics")).text)
    assert (before[("medic_approvals_waiting", ())], before[("medic_approval_oldest_wait_seconds", ())]) == (
        0,
        0,
    )

    asked = []
    for n in (1, 2, 3):
        waiting = incident(fault(f"a{n}"), id=f"inc-a{n}", node=f"gpu-00{n}")
        sqlite_store.record_events([waiting])
        sqlite_store.open_incident(waiting)
        with monkeypatch.context() as clock:  # the first was asked 40 minutes ago
            earlier = utcnow() - timedelta(minutes=40 if n == 1 else 0)
            clock.setattr(approvals_module, "utcnow", lambda at=earlier: at)
            asked.append(sqlite_store.request_approval(f"inc-a{n}", "reboot").id or 0)
        sqlite_store.update_incident(f"inc-a{n}", status=IncidentStatus.WAITING_FOR_APPROVAL)
    sqlite_store.answer_approval(asked[2], approved=True, by="alice", via="slack")  # answered: not waiting
    sqlite_store.update_incident("inc-a2", status=IncidentStatus.CLOSED)  # moved on: not waiting either
    async with serving(make_app(sqlite_store)) as client:
        after = samples((await client.get("/metrics")).text)
    assert after[("medic_approvals_waiting", ())] == 1
    assert 40 * 60 <= after[("medic_approval_oldest_wait_seconds", ())] < 41 * 60


# --- a real server process: kill -9 after the reply, `medic emit` ------------------------------


def test_acknowledged_events_survive_kill_9_and_a_restart(tmp_path: Path) -> None:
    database, port = tmp_path / "medic.db", free_port()
    url = f"http://127.0.0.1:{port}/v1/events"
    acknowledged: set[str] = set()
    with server_process(database, port) as process, httpx.Client(headers=BEARER) as client:
        for batch in range(5):
            ids = [f"b{batch}-{i}" for i in range(100)]
            response = client.post(url, json=[ev(i) for i in ids])
            assert response.status_code == 200
            acknowledged.update(ids)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    store = Store(f"sqlite:///{database}")
    assert stored_ids(store) == acknowledged
    store.close()

    with server_process(database, port), httpx.Client(headers=BEARER) as client:
        response = client.post(url, json=[ev("b4-99"), ev("after-restart")])
    assert response.json() == {"accepted": 1, "duplicates": ["b4-99"], "rejected": []}
    store = Store(f"sqlite:///{database}")
    assert stored_ids(store) == acknowledged | {"after-restart"}
    store.close()


def children(pid: int) -> set[int]:
    return set(children_of(pid))


def test_sigterm_stops_the_service_and_its_embedded_prefect_server(tmp_path: Path) -> None:
    home = {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": ""}
    with server_process(tmp_path / "medic.db", free_port(), home) as process:
        embedded = embedded_server(process)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM  # a clean exit, atexit hooks run
    deadline = time.monotonic() + 30
    while alive := {pid for pid in embedded if Path(f"/proc/{pid}").exists()}:
        assert time.monotonic() < deadline, f"the embedded Prefect server outlived medic serve: {alive}"
        time.sleep(0.2)


def embedded_server(process: subprocess.Popen[bytes]) -> set[int]:
    deadline = time.monotonic() + 90
    while not (embedded := children(process.pid)):  # the warm-up starts it in the background
        assert time.monotonic() < deadline, "the embedded Prefect server never started"
        time.sleep(0.2)
    return embedded


def test_an_embedded_prefect_server_left_by_kill_9_is_ended_by_the_next_start(tmp_path: Path) -> None:
    home = {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": ""}
    database, port = tmp_path / "medic.db", free_port()
    with server_process(database, port, home) as process:
        (left,) = embedded_server(process)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    time.sleep(1)
    assert Path(f"/proc/{left}").exists()  # nothing ended it: it serves Prefect's database for nobody
    try:
        with server_process(database, port, home) as restarted:
            assert embedded_server(restarted).isdisjoint({left})
            deadline = time.monotonic() + 30
            while Path(f"/proc/{left}").exists():
                assert time.monotonic() < deadline, "the restart left its predecessor's Prefect server"
                time.sleep(0.2)
            restarted.send_signal(signal.SIGTERM)
            restarted.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(left, signal.SIGKILL)


def cli() -> typer.Typer:
    from medic.apps.cli.serve import emit, serve

    app = typer.Typer()
    app.command("serve")(serve)
    app.command("emit")(emit)
    return app


def test_medic_emit_against_a_running_server(tmp_path: Path) -> None:
    database, port = tmp_path / "medic.db", free_port()
    env = {"MEDIC_URL": f"http://127.0.0.1:{port}", "MEDIC_TOKEN": TOKEN}
    events = tmp_path / "events.jsonl"
    events.write_text(lines(ev("from-file"), ev("bad-file", attributes={})), encoding="utf-8")
    runner = CliRunner()
    with server_process(database, port):
        built = runner.invoke(
            cli(),
            [
                *("emit", "--kind", "xid", "--node", "gpu-9", "--gpu", "3", "--job", "train-1"),
                *("--id", "cli-1", "--attr", "code=79", "--attr", "message=fell off the bus"),
            ],
            env=env,
        )
        from_file = runner.invoke(cli(), ["emit", "--file", str(events)], env=env)
        from_stdin = runner.invoke(cli(), ["emit", "-f", "-"], env=env, input=lines(ev("from-stdin")))
        wrong_token = runner.invoke(cli(), ["emit", "-f", str(events)], env=env | {"MEDIC_TOKEN": "nope"})
    assert built.exit_code == 0, built.output
    assert json.loads(built.stdout) == {"accepted": 1, "duplicates": [], "rejected": []}
    assert from_file.exit_code == 1
    assert json.loads(from_file.stdout)["rejected"] == [
        {"line": 2, "error": "attributes.code: Field required"}
    ]
    assert from_stdin.exit_code == 0
    assert wrong_token.exit_code == 1
    store = Store(f"sqlite:///{database}")
    # The service remediates what it stores, so the events may already belong to incidents.
    everything = store.events_between(datetime(2000, 1, 1, tzinfo=UTC), datetime(2100, 1, 1, tzinfo=UTC))
    events_by_id = {e.id: e for e in everything}
    store.close()
    assert set(events_by_id) == {"cli-1", "from-file", "from-stdin"}
    event = events_by_id["cli-1"]
    assert (event.node, event.gpu, event.job, event.source) == ("gpu-9", 3, "train-1", "medic-emit")
    assert event.attributes == {"code": 79, "message": "fell off the bus"}
    assert datetime.now(UTC) - event.time < timedelta(minutes=1)


def test_medic_emit_without_a_server_or_a_token_fails(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["emit", "--kind", "xid", "--node", "n", "--attr", "code=79"]
    no_server = runner.invoke(
        cli(), args, env={"MEDIC_URL": f"http://127.0.0.1:{free_port()}", "MEDIC_TOKEN": "t"}
    )
    no_token = runner.invoke(cli(), args, env={"MEDIC_TOKEN": ""})
    assert no_server.exit_code == 1 and "error" in no_server.stderr
    assert no_token.exit_code == 2 and "MEDIC_TOKEN" in no_token.output


def test_medic_serve_refuses_to_start_without_credentials(tmp_path: Path) -> None:
    env = {"MEDIC_INGEST_TOKENS": " , ", "MEDIC_INGEST_HMAC_SECRET": "", "MEDIC_HOME": str(tmp_path)}
    result = CliRunner().invoke(cli(), ["serve", "--port", str(free_port())], env=env)
    assert result.exit_code == 2
    assert "MEDIC_INGEST_TOKENS" in result.stderr


@pytest.mark.parametrize(
    ("pair", "expected"),
    [
        ("code=79", ("code", 79)),
        ("msg=a=b", ("msg", "a=b")),
        ("list=[1, 2]", ("list", [1, 2])),
        ("s=", ("s", "")),
    ],
)
def test_emit_attributes_are_json_when_they_parse(pair: str, expected: tuple[str, Any]) -> None:
    assert parse_attribute(pair) == expected


def test_emit_attribute_without_a_key_is_refused() -> None:
    with pytest.raises(ValueError, match="key=value"):
        parse_attribute("=3")


def processes_with(variable: str) -> set[int]:
    """Processes whose environment holds `variable` (NAME=value): this test's servers, whoever their parent."""
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if variable.encode() in environ.read_bytes().split(b"\0"):
                found.add(int(environ.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def running(pid: int) -> bool:
    """Alive: a zombie (exited, waiting for init to reap it) holds nothing and counts as gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def test_sigterm_during_a_sentry_burst_stops_within_10_s_and_a_restart_finishes_the_work(
    tmp_path: Path,
) -> None:
    from bench.sentry import SECRET as SENTRY_SECRET
    from bench.sentry import webhook

    home = f"PREFECT_HOME={tmp_path / 'prefect'}"
    env = {
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": "",
        "MEDIC_BACKENDS": "sim",
        "MEDIC_SIM_NODES": "40",
        "MEDIC_SENTRY_CLIENT_SECRET": SENTRY_SECRET,
    }
    database, port = tmp_path / "medic.db", free_port()
    url = f"http://127.0.0.1:{port}/v1/sentry"
    # 20, not a full Sentry burst of 40: the restart's flow runs for each are most of this test's time,
    # and 20 concurrent answers already keep the service busy when SIGTERM comes.
    webhooks = [webhook(f"sigterm-{i}", f"gpu-node-{i + 1}") for i in range(20)]

    def deliver(item: tuple[bytes, dict[str, str]]) -> str | None:
        body, headers = item
        try:
            response = httpx.post(url, content=body, headers=headers, timeout=30)
        except httpx.HTTPError:  # refused or cut off by the shutdown: Sentry would count a failure
            return None
        return (
            "sentry-" + json.loads(body)["data"]["event"]["event_id"] if response.status_code == 200 else None
        )

    with server_process(database, port, env) as process:
        deadline = time.monotonic() + 90
        while not children(process.pid):  # the embedded Prefect server, started by the warm-up
            assert time.monotonic() < deadline, "the embedded Prefect server never started"
            time.sleep(0.2)
        warm_body, warm_headers = webhook("sigterm-warm-up", "sigterm-warm-up")
        assert httpx.post(url, content=warm_body, headers=warm_headers, timeout=30).status_code == 200
        time.sleep(3)  # its flow run under way
        with ThreadPoolExecutor(len(webhooks)) as pool:
            answers = pool.map(deliver, webhooks)
            time.sleep(0.3)  # the burst in flight, and its first flow runs started
            embedded = children(process.pid)
            process.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            process.wait(timeout=30)
            took = time.monotonic() - stopped
        acknowledged = {a for a in answers if a}
    assert process.returncode == 128 + signal.SIGTERM
    assert took < 10, f"medic serve took {took:.1f} s to stop"
    assert embedded and not {pid for pid in embedded if running(pid)}
    assert processes_with(home) == set(), "a process of this service outlived it"

    store = Store(f"sqlite:///{database}")
    assert acknowledged <= stored_ids(store)  # every answered webhook was committed first
    store.close()
    # The next start hands on what was not handed on and resumes what was not finished.
    with server_process(database, free_port(), env) as restarted:
        store = Store(f"sqlite:///{database}")
        deadline = time.monotonic() + 180
        while True:
            with store.session() as s:
                statuses = list(s.exec(text("SELECT status FROM incidents")).scalars())
            unfinished = [st for st in statuses if st in ACTIVE_INCIDENT_STATUSES]
            if not unfinished and not store.undispatched_events():
                break
            assert time.monotonic() < deadline, f"left after the restart: {unfinished}"
            time.sleep(0.5)
        store.close()
        restarted.send_signal(signal.SIGTERM)  # not kill: its embedded Prefect server stops with it
        restarted.wait(timeout=30)
    assert processes_with(home) == set()
    assert len(statuses) >= len(acknowledged)


def test_a_token_in_the_query_string_never_reaches_the_access_log(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    env = os.environ | {
        "MEDIC_DATABASE_URL": f"sqlite:///{tmp_path / 'medic.db'}",
        "MEDIC_INGEST_TOKENS": TOKEN,
    }
    code = "import typer; from medic.apps.cli.serve import serve; typer.run(serve)"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", code, "--port", str(port), "--log-level", "info"],
            env=env,
            stdout=out,
            stderr=out,
        )
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/healthz?token={TOKEN}&x", timeout=1)
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, "the server did not start"
                    time.sleep(0.05)
            body = ev("q-1")
            httpx.post(f"http://127.0.0.1:{port}/v1/events?access_token={TOKEN}", json=body, headers=BEARER)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=15)
    written = log.read_text()
    assert "GET /healthz?token=***&x=***" in written
    assert "POST /v1/events?access_token=***" in written
    assert TOKEN not in written


def _rss_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


def _stream(total: int, chunk: int = 1 << 20) -> Iterator[bytes]:
    block = b"x" * chunk
    for _ in range(total // chunk):
        yield block


def _post_flood(url: str, headers: dict[str, str]) -> int | None:
    """POST 512 MB; the status, or None when the server closed the connection after refusing."""
    try:
        return httpx.post(url, content=_stream(512 << 20), headers=headers, timeout=60).status_code
    except httpx.HTTPError:
        return None


def test_a_512_mb_post_to_slack_is_refused_before_it_is_read(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/slack/interactions"
    env = {"SLACK_SIGNING_SECRET": "slack-signing-secret"}
    with server_process(tmp_path / "medic.db", port, env) as process:
        before = _rss_kb(process.pid)
        unsigned = _post_flood(url, {"Content-Type": "application/x-www-form-urlencoded"})
        fresh = {
            "X-Slack-Request-Timestamp": str(int(time.time())),
            "X-Slack-Signature": "v0=" + "0" * 64,
            "Content-Type": "application/x-www-form-urlencoded",
        }
        signed_looking = _post_flood(url, fresh)
        grown_mb = (_rss_kb(process.pid) - before) / 1024
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    assert unsigned in (401, None)  # answered 401 before the body; the client may see the close
    assert signed_looking in (413, None)  # read only up to 1 MiB
    assert grown_mb < 64, f"serve grew by {grown_mb:.0f} MB"


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["data", "source"])
async def test_a_rejected_cloudevent_with_a_lone_surrogate_is_kept(store: Store, where: str) -> None:
    """A lone surrogate cannot be stored as UTF-8: the rejection is kept with it escaped, not lost to a 500."""
    bad = cloudevent("ce-surrogate", attributes={"note": "\ud800"})  # no code: rejected
    if where == "source":
        bad["source"] = "agent\ud800"
    body = json.dumps([bad], ensure_ascii=True)  # as a sender writes it: the escape `\ud800`
    async with serving(make_app(store)) as client:
        response = await client.post(
            "/v1/events",
            content=body,
            headers=BEARER | {"Content-Type": "application/cloudevents-batch+json"},
        )
    assert response.status_code == 422, response.text
    (kept,) = store.rejections()
    assert "\\ud800" in kept.raw  # the escape's six characters, where the lone surrogate was
    assert "lone surrogate" in kept.reason


@pytest.mark.anyio
@pytest.mark.parametrize(
    "content_type", ["application/cloudevents+json", "application/cloudevents-batch+json", "application/json"]
)
async def test_a_null_specversion_with_a_time_past_the_last_utc_year_is_a_422_and_kept(
    store: Store, content_type: str
) -> None:
    """A fuzz of the intake once got a 500 for this CloudEvent (issue 38): 9999-12-31T23:59:59-01:00 is
    in year 10000 once in UTC. It must be a 4xx with its reason, kept in the dead letter."""
    bad = cloudevent("ce-null-specversion") | {"specversion": None, "time": "9999-12-31T23:59:59-01:00"}
    body = json.dumps([bad] if "batch" in content_type else bad)
    async with serving(make_app(store)) as client:
        response = await client.post(
            "/v1/events", content=body, headers=BEARER | {"Content-Type": content_type}
        )
    assert response.status_code == 422, response.text
    (error,) = [r["error"] for r in response.json()["rejected"]]
    assert "specversion" in error
    (kept,) = store.rejections()
    assert "9999-12-31T23:59:59-01:00" in kept.raw and "specversion" in kept.reason
    with_version = cloudevent("ce-year-10000") | {"time": "9999-12-31T23:59:59-01:00"}
    async with serving(make_app(store)) as client:
        late = await client.post(
            "/v1/events", json=with_version, headers=BEARER | {"Content-Type": "application/cloudevents+json"}
        )
    assert late.status_code == 422 and "not representable" in late.json()["rejected"][0]["error"], late.text


def test_only_a_database_that_does_not_answer_asks_the_sender_to_retry() -> None:
    assert unavailable(exc.OperationalError("SELECT 1", {}, Exception("connection refused")))
    assert unavailable(exc.InterfaceError("SELECT 1", {}, Exception("connection closed")))
    assert unavailable(exc.TimeoutError("QueuePool limit reached"))
    assert not unavailable(exc.IntegrityError("INSERT", {}, Exception("duplicate key")))
    assert not unavailable(exc.DataError("INSERT", {}, Exception("value too long")))
    assert not unavailable(ValueError("a bug of ours"))
