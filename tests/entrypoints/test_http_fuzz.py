"""Hostile HTTP at every route of `medic serve` (issue 15): hypothesis writes the methods, paths,
headers, content types, encodings and bodies; the real ASGI app, on a real SQLite store, answers.

Three things must hold for every request. No 5xx. A 4xx says why (`error`, `detail`, Slack's
`text`, or a reason per rejected item). And nothing is lost: the items an ingest answer counts
are in the store, each as an event, a dead-letter row or a rejection count, and a refused
request leaves the store as it was.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from checkout import TEST_FIXTURES
from factories import event_dict
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_hostile_input import JSON_VALUES, event_like

from medic.apps.server import sentry
from medic.apps.server.app import create_app
from medic.apps.server.auth import sign
from medic.apps.server.slack import SlackCallbacks
from medic.integrations.slack.blocks import APPROVE_ACTION, REJECT_ACTION
from medic.integrations.slack.signature import SECRET_ENV as SLACK_SECRET_ENV
from medic.store import Store
from medic.store.tables import ApprovalRecord, EventRecord, RejectedRecord

TOKEN = "fuzz-token"
HMAC_SECRET = b"fuzz-hmac-secret"
SENTRY_SECRET = b"fuzz-sentry-secret"
SLACK_SECRET = "fuzz-slack-secret"
MAX_BODY = 8 * 1024  # small, so that hypothesis reaches the 413 too
SENTRY_TEMPLATE = json.loads((TEST_FIXTURES / "sentry" / "event_alert_nan.json").read_text(encoding="utf-8"))
ALERTMANAGER_TEMPLATE = json.loads(
    (TEST_FIXTURES / "alertmanager" / "firing_xid.json").read_text(encoding="utf-8")
)
# About 1,000 requests in all: under a minute on 2 cores.
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Medic:
    portal: BlockingPortal
    client: httpx.AsyncClient
    store: Store

    def request(self, method: str, path: str, **options: Any) -> httpx.Response:
        return self.portal.call(partial(self.client.request, method, path, **options))

    def post(self, path: str, **options: Any) -> httpx.Response:
        return self.request("POST", path, **options)

    def tally(self) -> tuple[int, int, int]:
        """Events stored, dead-letter rows, rejections counted (kept or not)."""
        counted = sum(c.rejected for c in self.store.rejection_counts())
        return self.store.count(EventRecord), self.store.count(RejectedRecord), counted


@pytest.fixture(scope="module")
def medic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Medic]:
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'medic.db'}")

    def claim(incident: str, approved: bool, by: str) -> tuple[ApprovalRecord | None, bool]:
        return None, True

    slack = SlackCallbacks(
        approvers=lambda: ["U-APPROVER"],
        resume=lambda _run, _answer: None,
        claim=claim,
        reopen=lambda _: None,
    )
    app = create_app(
        store,
        tokens={TOKEN},
        hmac_secret=HMAC_SECRET,
        on_accepted=None,
        max_body_bytes=MAX_BODY,
        slack=slack,
        sentry_secret=SENTRY_SECRET,
    )
    # httpx's ASGI transport hands the app the header bytes as sent (Starlette's TestClient re-encodes
    # them), and raises a server exception here, with its traceback, rather than answering 500.
    transport = httpx.ASGITransport(app=app, client=("10.0.0.9", 40000))
    with pytest.MonkeyPatch.context() as patch, start_blocking_portal() as portal:
        patch.setenv(SLACK_SECRET_ENV, SLACK_SECRET)
        client = httpx.AsyncClient(transport=transport, base_url="http://medic")
        try:
            yield Medic(portal, client, store)
        finally:
            portal.call(client.aclose)
    store.close()


def has_reason(response: httpx.Response) -> bool:
    answer = response.json()
    if not isinstance(answer, dict):
        return False
    if "rejected" in answer:
        return bool(answer["rejected"]) and all(
            isinstance(p["error"], str) and p["error"] for p in answer["rejected"]
        )
    return any(isinstance(answer.get(key), str) and answer[key] for key in ("error", "detail", "text"))


def wire(headers: dict[str, str]) -> dict[str, bytes]:
    """Header values as bytes on the wire (httpx takes ASCII text only): one byte a character where
    latin-1 has it, as servers read headers back, else UTF-8, as a careless client sends them."""
    return {name: _header_bytes(value) for name, value in headers.items()}


def _header_bytes(value: str) -> bytes:
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass")


def answered(response: httpx.Response, method: str = "POST") -> None:
    assert response.status_code < 500, response.text[:2000]
    if response.status_code >= 400 and method != "HEAD":  # a HEAD answer has no body
        assert has_reason(response), (response.status_code, response.text[:2000])


# --- strategies -----------------------------------------------------------------------------

# Header values as HTTP carries them: latin-1 text without control characters.
HEADER_TEXT = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40
)
# Numbers as headers carry them, and what only looks like one: `str.isdigit` holds for "²", int() fails.
ODD_NUMBERS = ["", "0", "-1", " 12 ", "1e3", "²", "١٢", "99999999999999999999999"]
CONTENT_TYPES = st.one_of(
    st.sampled_from(
        [
            "application/json",
            "application/json; charset=utf-8",
            "application/x-ndjson",
            "application/jsonl",
            "APPLICATION/X-NDJSON ; charset=latin-1",
            "application/cloudevents+json",
            "application/cloudevents-batch+json",
            "application/x-www-form-urlencoded",
            "text/plain",
            "multipart/form-data; boundary=x",
            "",
        ]
    ),
    HEADER_TEXT,
)
KINDS = ["xid", "ecc", "thermal", "gpu_missing", "diagnostic", "nan_loss", "remediation", "straggler"]
EVENT_IDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)


@st.composite
def valid_event(draw: st.DrawFn) -> dict[str, Any]:
    return event_dict(draw(st.sampled_from(KINDS)), id=draw(EVENT_IDS))


@st.composite
def cloudevent(draw: st.DrawFn) -> dict[str, Any]:
    """A structured-mode CloudEvent, valid or with any attribute replaced or dropped."""
    inner = event_dict(draw(st.sampled_from(KINDS)), id=draw(EVENT_IDS))
    event: dict[str, Any] = {
        "specversion": "1.0",
        "type": f"medic.fault.{inner.pop('kind')}",
        "id": inner.pop("id"),
        "source": inner.pop("source"),
        "time": inner.pop("time"),
        "data": inner,
    }
    for key in draw(st.lists(st.sampled_from([*event, "data_base64", "subject"]), max_size=2)):
        if draw(st.booleans()):
            event[key] = draw(JSON_VALUES)
        else:
            event.pop(key, None)
    return event


ITEM = st.one_of(valid_event(), cloudevent(), JSON_VALUES, st.builds(dict))
LINE = st.one_of(
    valid_event().map(json.dumps),
    cloudevent().map(json.dumps),
    event_like(),
    JSON_VALUES.map(json.dumps),
    st.text(max_size=40),
).map(lambda line: line.replace("\n", " "))


@dataclass(frozen=True)
class Post:
    body: bytes
    headers: dict[str, str]
    items: int | None  # how many items the body holds, where the test can tell


def lines_in(body: bytes) -> int:
    """The items of a JSON-lines body as docs/serve.md counts them: non-blank lines, read as UTF-8."""
    return sum(1 for line in body.decode("utf-8-sig", "replace").split("\n") if line.strip())


@st.composite
def ingest_body(draw: st.DrawFn) -> Post:
    shape = draw(st.sampled_from(["lines", "array", "one", "batch", "binary", "bytes", "big"]))
    if shape == "lines":
        body = "\n".join(draw(st.lists(LINE, max_size=8))).encode("utf-8", "surrogatepass")
        media = draw(st.sampled_from(["application/x-ndjson", "application/ndjson", "application/jsonl"]))
        return Post(body, {"Content-Type": media}, lines_in(body))
    if shape == "array":
        items = draw(st.lists(ITEM, max_size=6))
        return Post(json.dumps(items).encode(), {"Content-Type": "application/json"}, len(items))
    if shape == "one":  # a JSON array is read as a batch, whatever the type says
        item = draw(ITEM)
        count = len(item) if isinstance(item, list) else 1
        return Post(json.dumps(item).encode(), {"Content-Type": "application/cloudevents+json"}, count)
    if shape == "batch":
        items = draw(st.lists(cloudevent(), max_size=4))
        return Post(
            json.dumps(items).encode(), {"Content-Type": "application/cloudevents-batch+json"}, len(items)
        )
    if shape == "binary":  # CloudEvents binary mode: attributes in ce-* headers, data as the body
        event = draw(cloudevent())
        names = [k for k in event if k != "data"] + draw(
            st.lists(st.sampled_from(["datacontenttype", "x"]), max_size=1)
        )
        headers = {
            f"ce-{name}": draw(
                st.one_of(st.just(str(event.get(name, ""))), HEADER_TEXT, st.just("%ZZ%C3%28"))
            )
            for name in names
        }
        data = draw(st.one_of(st.just(event.get("data")), JSON_VALUES))
        headers["Content-Type"] = draw(st.sampled_from(["application/json", "text/plain", ""]))
        return Post(json.dumps(data).encode(), headers, 1)
    if shape == "big":
        return Post(b"[" + b" " * draw(st.integers(MAX_BODY - 10, MAX_BODY + 100)) + b"]", {}, None)
    return Post(draw(st.binary(max_size=300)), {"Content-Type": draw(CONTENT_TYPES)}, None)


@st.composite
def encoded(draw: st.DrawFn, post: Post) -> Post:
    """The body as sent: UTF-8, or re-encoded, or compressed (which the server refuses: 415)."""
    coding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "utf-16", "latin-1", "gzip", "bom"]))
    if coding == "utf-8":
        return post
    if coding == "gzip":
        return Post(gzip.compress(post.body), post.headers | {"Content-Encoding": "gzip"}, None)
    if coding == "bom":
        return Post(b"\xef\xbb\xbf" + post.body, post.headers, post.items)
    text = post.body.decode("utf-8", "replace")
    return Post(text.encode(coding, "replace"), post.headers, None)


@st.composite
def credentials(draw: st.DrawFn, body: bytes) -> tuple[dict[str, str], bool]:
    """Headers that authenticate the body or not, and whether they do."""
    choice = draw(st.sampled_from(["bearer", "bearer", "hmac", "wrong", "none", "hmac-other", "header-junk"]))
    if choice == "bearer":
        scheme = draw(st.sampled_from(["Bearer", "bearer", "BEARER"]))
        return {"Authorization": f"{scheme} {TOKEN}"}, True
    if choice == "hmac":
        return {"X-Medic-Signature": sign(body, HMAC_SECRET)}, True
    if choice == "hmac-other":
        return {"X-Medic-Signature": sign(body + b"x", HMAC_SECRET)}, False
    if choice == "wrong":
        return {"Authorization": draw(HEADER_TEXT)}, False
    if choice == "header-junk":
        return {"X-Medic-Signature": draw(HEADER_TEXT)}, False
    return {}, False


# --- POST /v1/events ------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_fuzz_post_events_answers_and_accounts_for_every_item(medic: Medic, data: st.DataObject) -> None:
    post = data.draw(ingest_body().flatmap(encoded))
    auth, authentic = data.draw(credentials(post.body))
    before = medic.tally()
    response = medic.post("/v1/events", content=post.body, headers=wire(post.headers | auth))
    answered(response)
    after = medic.tally()
    change = tuple(a - b for a, b in zip(after, before, strict=True))
    if authentic and "Content-Encoding" in post.headers:  # refused, never misread as junk text
        assert response.status_code in (413, 415)
    if response.status_code not in (200, 422):
        assert change == (0, 0, 0), response.status_code  # refused: nothing stored, nothing dead-lettered
        assert response.status_code in (401, 413, 415)
        # Not authentic: 401, or 413 when the body is too big to be read for its signature.
        assert authentic or response.status_code in (401, 413)
        return
    assert authentic
    reply = response.json()
    rejected = reply.get("rejected_total", len(reply["rejected"]))
    kept = reply.get("dead_lettered", len(reply["rejected"]))
    assert change == (reply["accepted"], kept, rejected)
    assert (response.status_code == 422) == (rejected > 0)
    if post.items is not None:
        assert reply["accepted"] + len(reply["duplicates"]) + rejected == post.items, reply


# --- POST /v1/sentry ------------------------------------------------------------------------


@st.composite
def sentry_payload(draw: st.DrawFn) -> bytes:
    """Sentry's event_alert shape with parts replaced by anything, or not JSON at all."""
    payload = json.loads(json.dumps(SENTRY_TEMPLATE))
    event = payload["data"]["event"]
    event["event_id"] = draw(st.text(min_size=1, max_size=32))
    targets: list[tuple[dict[str, Any], str]] = [(payload, "data"), (payload["data"], "event")]
    targets += [
        (event, key) for key in ("event_id", "title", "datetime", "exception", "tags", "timestamp", "message")
    ]
    for parent, key in draw(st.lists(st.sampled_from(targets), max_size=2)):
        parent[key] = draw(JSON_VALUES)
    if draw(st.booleans()):
        event["exception"] = {"values": [{"type": "RuntimeError", "value": draw(st.text(max_size=80))}]}
    text = json.dumps(payload, ensure_ascii=draw(st.booleans()))
    return draw(st.one_of(st.just(text.encode("utf-8", "surrogatepass")), st.binary(max_size=200)))


@FUZZ
@given(
    body=sentry_payload(),
    signed=st.sampled_from(["good", "good", "good", "wrong", "none", "junk"]),
    resource=st.one_of(st.sampled_from(["event_alert", "error", "issue", "installation"]), HEADER_TEXT),
    stamp=st.one_of(st.sampled_from(["now"] * 4 + ODD_NUMBERS), HEADER_TEXT),
)
# Found by this fuzz, kept: "²" passes `str.isdigit`, and int() raised on it (a 500 to a signed request).
@example(body=json.dumps(SENTRY_TEMPLATE).encode(), signed="good", resource="event_alert", stamp="²")
def test_fuzz_post_sentry(medic: Medic, body: bytes, signed: str, resource: str, stamp: str) -> None:
    signature = {
        "good": hmac.new(SENTRY_SECRET, body, hashlib.sha256).hexdigest(),
        "wrong": hmac.new(b"guess", body, hashlib.sha256).hexdigest(),
        "junk": resource,
    }.get(signed)
    headers = {sentry.RESOURCE_HEADER: resource, "Content-Type": "application/json"}
    headers[sentry.TIMESTAMP_HEADER] = str(int(time.time())) if stamp == "now" else stamp
    if signature is not None:
        headers[sentry.SIGNATURE_HEADER] = signature
    before = medic.tally()
    response = medic.post("/v1/sentry", content=body, headers=wire(headers))
    answered(response)
    change = tuple(a - b for a, b in zip(medic.tally(), before, strict=True))
    if signed != "good" or stamp != "now":
        assert (response.status_code, change) == (401, (0, 0, 0))
    elif response.status_code == 202:  # no error event, or no GPU fault in it: acknowledged, dropped
        assert change == (0, 0, 0)
    else:
        reply = response.json()
        assert change == (reply["accepted"], len(reply["rejected"]), len(reply["rejected"]))
        assert reply["accepted"] + len(reply["duplicates"]) + len(reply["rejected"]) == 1


# --- POST /v1/alertmanager -----------------------------------------------------------------


@st.composite
def alertmanager_payload(draw: st.DrawFn) -> bytes:
    """Alertmanager's webhook with parts of it and of its alert replaced by anything, or bytes."""
    payload = json.loads(json.dumps(ALERTMANAGER_TEMPLATE))
    alert = payload["alerts"][0]
    alert["status"] = draw(st.sampled_from(["firing", "resolved"]))
    targets: list[tuple[dict[str, Any], str]] = [(payload, k) for k in ("version", "alerts", "status")]
    targets += [(alert, k) for k in ("labels", "annotations", "startsAt", "fingerprint")]
    targets += [(alert["labels"], k) for k in ("dcgm_field", "Hostname", "instance", "gpu", "alertname")]
    targets += [(alert["annotations"], "value")]
    for parent, key in draw(st.lists(st.sampled_from(targets), max_size=2)):
        parent[key] = draw(JSON_VALUES)
    text = json.dumps(payload, ensure_ascii=draw(st.booleans()))
    return draw(st.one_of(st.just(text.encode("utf-8", "surrogatepass")), st.binary(max_size=200)))


@FUZZ
@given(body=alertmanager_payload(), credentials=st.sampled_from(["bearer", "basic", "none", "junk"]))
def test_fuzz_post_alertmanager(medic: Medic, body: bytes, credentials: str) -> None:
    authorization = {
        "bearer": f"Bearer {TOKEN}",
        "basic": "Basic " + base64.b64encode(f"am:{TOKEN}".encode()).decode(),
        "junk": "Basic " + base64.b64encode(b"am:guess").decode(),
    }.get(credentials)
    headers = {"Content-Type": "application/json"} | (
        {"Authorization": authorization} if authorization else {}
    )
    before = medic.tally()
    response = medic.post("/v1/alertmanager", content=body, headers=wire(headers))
    answered(response)
    change = tuple(a - b for a, b in zip(medic.tally(), before, strict=True))
    if credentials in ("none", "junk"):
        assert (response.status_code, change) == (401, (0, 0, 0))
        return
    reply = response.json()
    if response.status_code == 413:
        assert change == (0, 0, 0)
        return
    rejected = reply.get("rejected_total", len(reply["rejected"]))
    assert change == (reply["accepted"], reply.get("dead_lettered", rejected), rejected)
    assert response.status_code == (422 if rejected else 202 if reply.get("ignored") else 200)


# --- POST /v1/slack/interactions ------------------------------------------------------------


@st.composite
def slack_body(draw: st.DrawFn) -> bytes:
    """A click on Approve or Reject with parts replaced by anything, another form, or bytes."""
    value: Any = {"flow_run": draw(st.one_of(st.uuids().map(str), st.text(max_size=10))), "incident": "inc-1"}
    action: Any = {
        "action_id": draw(st.sampled_from([APPROVE_ACTION, REJECT_ACTION, "other"])),
        "value": json.dumps(value),
    }
    payload: Any = {
        "type": "block_actions",
        "user": {"id": "U-APPROVER", "username": "sre"},
        "actions": [action],
    }
    targets: list[tuple[Any, str]] = [
        (payload, "user"),
        (payload, "actions"),
        (action, "value"),
        (action, "action_id"),
    ]
    for parent, key in draw(st.lists(st.sampled_from(targets), max_size=2)):
        parent[key] = draw(JSON_VALUES)
    if draw(st.integers(0, 5)) == 0:
        payload = draw(JSON_VALUES)
    form = urlencode({"payload": json.dumps(payload)}).encode()
    return draw(st.one_of(st.just(form), st.just(form), st.binary(max_size=200), st.just(b"payload=%ZZ")))


def slack_signed(body: bytes, sent_at: int, secret: str = SLACK_SECRET) -> dict[str, str]:
    base = b"v0:" + str(sent_at).encode() + b":" + body
    digest = hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()
    return {"X-Slack-Request-Timestamp": str(sent_at), "X-Slack-Signature": f"v0={digest}"}


@FUZZ
@given(
    body=slack_body(),
    signed=st.sampled_from(["good", "good", "good", "stale", "other-secret", "none", "junk"]),
    junk=st.one_of(HEADER_TEXT, st.sampled_from(ODD_NUMBERS)),
)
# Found by this fuzz, kept: slack-sdk raised on a body not UTF-8 (a 500, even with a wrong
# signature); a payload not a JSON object, or with `actions` not a list, raised in parse_click.
@example(body=b"\x80", signed="good", junk="")
@example(body=b"\x80", signed="other-secret", junk="")
@example(body=b"payload=null", signed="good", junk="")
@example(body=b"payload=%7B%22actions%22%3A%205%7D", signed="good", junk="")
@example(body=b"payload=" + b"%5B" * 5000, signed="good", junk="")
def test_fuzz_slack_interactions(medic: Medic, body: bytes, signed: str, junk: str) -> None:
    now = int(time.time())
    headers = {
        "good": slack_signed(body, now),
        "stale": slack_signed(body, now - 3600),
        "other-secret": slack_signed(body, now, "guess"),
        "junk": {"X-Slack-Request-Timestamp": junk, "X-Slack-Signature": junk},
    }.get(signed, {})
    before = medic.tally()
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    response = medic.post("/v1/slack/interactions", content=body, headers=wire(headers | form))
    answered(response)
    assert medic.tally() == before
    if signed != "good":
        assert response.status_code == 401


# --- any method, any path -------------------------------------------------------------------

PATHS = [
    "/v1/events",
    "/v1/sentry",
    "/v1/alertmanager",
    "/v1/slack/interactions",
    "/healthz",
    "/metrics",
    "/",
    "/v1",
    "/docs",
]


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE"]),
    path=st.one_of(st.sampled_from(PATHS), st.text(max_size=30).map(lambda p: "/" + quote(p, safe="/"))),
    query=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    headers=st.dictionaries(
        st.sampled_from(
            ["Accept", "Content-Type", "Content-Length", "Authorization", "ce-id", "Content-Encoding"]
        ),
        st.one_of(HEADER_TEXT, st.sampled_from(ODD_NUMBERS)),
        max_size=3,
    ),
    body=st.binary(max_size=100),
)
# Found by this fuzz, kept: a Content-Length of "²" passed `str.isdigit` and int() raised on it.
@example(method="POST", path="/v1/sentry", query={}, headers={"Content-Length": "²"}, body=b"{}")
def test_fuzz_any_method_and_path(
    medic: Medic, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: bytes
) -> None:
    before = medic.tally()
    response = medic.request(method, path, params=query, headers=wire(headers), content=body or None)
    answered(response, method)
    if path in ("/healthz", "/metrics") and method == "GET":
        assert response.status_code == 200
    assert medic.tally() == before  # no credentials: nothing stored
