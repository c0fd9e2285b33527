"""SlackNotifier through the real slack-sdk WebClient against a local server that answers like Slack's Web
API (tests/slack_api.py), the Block Kit rendering, and Slack request signature checks."""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import logging
import time
import traceback
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path, PurePosixPath
from urllib.parse import urlencode

import pytest
from fake_time import FakeTime
from fastapi.testclient import TestClient
from slack_api import SlackApi, running_slack_api, slack_user
from slack_sdk import WebClient
from torchrun_support import free_port

from medic.apps.server.app import create_app
from medic.apps.server.slack import SlackCallbacks
from medic.artifacts import Artifact, ArtifactLinks
from medic.integrations import registry
from medic.integrations.slack.blocks import (
    APPROVE_ACTION,
    FIELDS_MAX,
    HEADER_MAX,
    SECTION_TEXT_MAX,
    escape,
    fallback_text,
    fit_mrkdwn,
    message_blocks,
)
from medic.integrations.slack.notifier import (
    NotifyError,
    SlackNotifier,
    current_flow_run_url,
    retry_after_s,
    split_thread,
)
from medic.integrations.slack.signature import SignatureError, verify
from medic.protocols import Message, Notifier
from medic.store import Store
from medic.tasks.runtime.process import Runtime

TOKEN = "xoxb-1111-2222-medictesttokenvalue"
CHANNEL_ID = "C0GPUALERTS"
FLOW_RUN_URL = "http://prefect.example/flow-runs/flow-run/0b5e"
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"

MESSAGE = Message(
    incident="inc-42",
    channel="#gpu-alerts",
    title="Hardware fault on node-7: replace",
    body="XID 79 on GPU 3 & the node fell off the bus\nDecision: rule `xid-79` — replace",
    recommend=("Open a vendor RMA for node-7", "Check the PSU on rack r12"),
    fields={"node": "node-7", "gpu": "3", "jobs": "job-1, job-2", "owner": "", "flow run": "brave-otter"},
)


@pytest.fixture
def slack_api() -> Iterator[SlackApi]:
    with running_slack_api(TOKEN, {"gpu-alerts": CHANNEL_ID}) as api:
        yield api


@pytest.fixture
def fake_time() -> FakeTime:
    return FakeTime()


def make_notifier(
    base_url: str, fake_time: FakeTime, *, token: str = TOKEN, max_wait_s: float = 30
) -> SlackNotifier:
    client = WebClient(token=token, base_url=base_url, retry_handlers=[], timeout=5)
    return SlackNotifier(
        client,
        flow_run_url=lambda _message: FLOW_RUN_URL,
        max_wait_s=max_wait_s,
        sleep=fake_time.sleep,
        clock=fake_time.clock,
    )


@pytest.fixture
def notifier(slack_api: SlackApi, fake_time: FakeTime) -> SlackNotifier:
    return make_notifier(slack_api.api_url, fake_time)


def posted(slack_api: SlackApi) -> list[dict]:
    return [r.params for r in slack_api.requests if r.method == "chat.postMessage" and r.status == 200]


# --- posting, threads, updates ---


def test_post_returns_channel_id_and_ts_and_replies_stay_in_the_thread(
    notifier: SlackNotifier, slack_api: SlackApi
) -> None:
    assert isinstance(notifier, Notifier)
    thread = notifier.post(MESSAGE)
    channel, ts = split_thread(thread)
    assert channel == CHANNEL_ID  # Slack's id, not the "#gpu-alerts" the message named

    notifier.reply(thread, "node-7 rebooted")
    notifier.reply(thread, "job-1 resumed from step 400 <ok>")

    first, *replies = posted(slack_api)
    assert first["channel"] == "#gpu-alerts" and "thread_ts" not in first
    assert [r["thread_ts"] for r in replies] == [ts, ts]
    assert [r["text"] for r in replies] == ["node-7 rebooted", "job-1 resumed from step 400 &lt;ok&gt;"]
    reply_ts = [slack_api.message(CHANNEL_ID, r["thread_ts"]) for r in replies]
    assert all(m["ts"] == ts for m in reply_ts)
    assert all(r.headers["Authorization"] == f"Bearer {TOKEN}" for r in slack_api.requests)


def test_update_rewrites_the_first_message_of_the_thread(
    notifier: SlackNotifier, slack_api: SlackApi
) -> None:
    thread = notifier.post(MESSAGE)
    resolved = Message(
        incident=MESSAGE.incident, channel=MESSAGE.channel, title="Resolved: node-7 replaced", body="All good"
    )
    notifier.update(thread, resolved)

    channel, ts = split_thread(thread)
    stored = slack_api.message(channel, ts)
    assert stored["edited"] is True
    assert stored["blocks"][0]["text"]["text"] == "Resolved: node-7 replaced"
    assert stored["text"] == "Resolved: node-7 replaced\nAll good"
    assert [r.method for r in slack_api.requests] == ["chat.postMessage", "chat.update"]


def test_the_posted_blocks_show_title_body_fields_recommendations_link_and_incident(
    notifier: SlackNotifier, slack_api: SlackApi
) -> None:
    notifier.post(MESSAGE)
    (sent,) = posted(slack_api)
    by_type: dict[str, list[dict]] = {}
    for block in sent["blocks"]:
        by_type.setdefault(block["type"], []).append(block)

    assert sent["blocks"][0] == {"type": "header", "text": {"type": "plain_text", "text": MESSAGE.title}}
    body, fields, recommended = by_type["section"]
    assert body["text"] == {"type": "mrkdwn", "text": escape(MESSAGE.body)}
    assert "&amp; the node" in body["text"]["text"]
    assert [f["text"] for f in fields["fields"]] == [
        "*Node*\nnode-7",
        "*GPU*\n3",
        "*Jobs*\njob-1, job-2",
        "*Flow run*\nbrave-otter",  # the empty owner is left out
    ]
    assert recommended["text"]["text"] == (
        "*Recommended actions*\n• Open a vendor RMA for node-7\n• Check the PSU on rack r12"
    )
    (button,) = by_type["actions"][0]["elements"]
    assert button["url"] == FLOW_RUN_URL
    assert "`inc-42`" in by_type["context"][0]["elements"][0]["text"]
    assert sent["text"] == escape(f"{MESSAGE.title}\n{MESSAGE.body}")
    assert sent["unfurl_links"] is False


def test_evidence_files_are_links_where_served_and_paths_otherwise(slack_api: SlackApi) -> None:
    served = "/shared/medic/llm-r2-step16-profile.pt.trace.json"
    message = replace(
        MESSAGE,
        artifacts=(
            Artifact("profile of rank 2 on node-b", served),
            Artifact("stack dump of rank 3 on node-b", "/var/tmp/llm-r3-step12-stacks.txt"),
        ),
    )
    notifier = SlackNotifier.from_env(
        {
            "SLACK_BOT_TOKEN": TOKEN,
            "SLACK_API_URL": slack_api.api_url,
            "MEDIC_ARTIFACT_ROOT": "/shared/medic",
            "MEDIC_ARTIFACT_URL": "https://files.example/medic/",
        }
    )
    assert notifier is not None
    notifier.post(message)
    (sent,) = posted(slack_api)
    [files] = [b for b in sent["blocks"] if b.get("text", {}).get("text", "").startswith("*Evidence files*")]
    assert files["text"]["text"] == (
        "*Evidence files*\n"
        "• <https://files.example/medic/llm-r2-step16-profile.pt.trace.json|profile of rank 2 on node-b>\n"
        "• stack dump of rank 3 on node-b: `/var/tmp/llm-r3-step12-stacks.txt`"  # not served: its path
    )


# --- Block Kit limits ---


def _unescaped_whole(text: str) -> bool:
    """True when no entity was cut in half: unescaping and escaping again gives the same text."""
    return escape(html.unescape(text)) == text


def test_oversized_messages_are_cut_to_block_kit_limits_without_splitting_entities() -> None:
    big = Message(
        incident="inc-1",
        channel="#c",
        title="T" * 400,
        body="a<&" * 3000,
        recommend=tuple(f"step {i} & more" for i in range(500)),
        fields={f"f{i}": "v&" * 1500 for i in range(15)},
    )
    blocks = message_blocks(big, "http://x/" + "p" * 3000)

    header = blocks[0]["text"]["text"]
    assert len(header) == HEADER_MAX and header.endswith("…")
    sections = [b for b in blocks if b["type"] == "section"]
    for section in sections:
        if "text" in section:
            text = section["text"]["text"]
            assert len(text) <= SECTION_TEXT_MAX and text.endswith("…")
            assert _unescaped_whole(text.removesuffix("…"))
    fields = sections[1]["fields"]
    assert len(fields) == FIELDS_MAX
    assert all(len(f["text"]) <= 2000 and _unescaped_whole(f["text"].removesuffix("…")) for f in fields)
    assert not [b for b in blocks if b["type"] == "actions"]  # a URL over 3000 characters is dropped
    assert len(fallback_text(big)) <= 4000


def test_many_evidence_files_show_whole_links_as_far_as_they_fit() -> None:
    many = tuple(Artifact(f"profile of rank {i} & co", f"/shared/{'d' * 150}/r{i}.json") for i in range(100))
    links = ArtifactLinks(PurePosixPath("/shared"), "https://files.example")
    [files] = message_blocks(
        Message(incident="i", channel="#c", title="t", body="", artifacts=many), None, links
    )[1:2]
    text = files["text"]["text"]
    *lines, more = text.splitlines()
    assert len(text) <= SECTION_TEXT_MAX and lines[0] == "*Evidence files*"
    assert more == f"… and {100 - len(lines) + 1} more"
    assert all(
        line.startswith("• <https://files.example/") and line.endswith("&amp; co>") for line in lines[1:]
    )


@pytest.mark.parametrize("limit", range(1, 12))
def test_fit_mrkdwn_never_exceeds_the_limit(limit: int) -> None:
    fitted = fit_mrkdwn("<&>" * 10, limit)
    assert len(fitted) <= limit
    assert _unescaped_whole(fitted.removesuffix("…"))


def test_a_blank_title_falls_back_to_the_incident() -> None:
    blocks = message_blocks(Message(incident="inc-9", channel="#c", title=" ", body=""))
    assert blocks[0]["text"]["text"] == "Incident inc-9"
    assert [b["type"] for b in blocks] == ["header", "context"]  # Slack rejects empty sections


# --- rate limits, server errors, budgets ---


@pytest.mark.parametrize(("header", "wait"), [("1", 1.0), ("0.5", 0.5)])
def test_a_429_is_retried_after_the_time_slack_asks_for(
    notifier: SlackNotifier, slack_api: SlackApi, fake_time: FakeTime, header: str, wait: float
) -> None:
    slack_api.fail_next(1, 429, retry_after=header)
    thread = notifier.post(MESSAGE)
    assert fake_time.sleeps == [wait]
    assert [r.status for r in slack_api.requests] == [429, 200]
    assert split_thread(thread)[0] == CHANNEL_ID


def test_persistent_429_gives_up_with_notify_error_within_max_wait(
    slack_api: SlackApi, fake_time: FakeTime
) -> None:
    notifier = make_notifier(slack_api.api_url, fake_time, max_wait_s=3)
    slack_api.fail_next(50, 429, retry_after="1")
    with pytest.raises(NotifyError, match=r"failed 4 time\(s\), last with HTTP 429 ratelimited.*3 s"):
        notifier.post(MESSAGE)
    assert fake_time.sleeps == [1.0, 1.0, 1.0]
    assert len(slack_api.requests) == 4


def test_a_retry_after_beyond_the_budget_fails_at_once(slack_api: SlackApi, fake_time: FakeTime) -> None:
    notifier = make_notifier(slack_api.api_url, fake_time, max_wait_s=30)
    slack_api.fail_next(1, 429, retry_after="120")
    with pytest.raises(NotifyError, match="429"):
        notifier.reply(f"{CHANNEL_ID}:1.0", "hello")
    assert fake_time.sleeps == []


def test_a_500_is_retried_with_backoff_and_then_succeeds(
    notifier: SlackNotifier, slack_api: SlackApi, fake_time: FakeTime
) -> None:
    slack_api.fail_next(2, 500)
    notifier.post(MESSAGE)
    assert [r.status for r in slack_api.requests] == [500, 500, 200]
    first, second = fake_time.sleeps
    # slack-sdk's backoff: 0.5 s then 1 s, each plus up to 1 s of jitter.
    assert 0.5 <= first <= 1.5 and 1.0 <= second <= 2.0


def test_an_unreachable_slack_is_retried_until_the_budget_is_spent(fake_time: FakeTime) -> None:
    notifier = make_notifier(f"http://127.0.0.1:{free_port()}/api/", fake_time, max_wait_s=5)
    with pytest.raises(NotifyError, match=r"URLError.*5 s"):
        notifier.post(MESSAGE)
    assert len(fake_time.sleeps) >= 2 and sum(fake_time.sleeps) <= 5


def test_a_refusal_is_not_retried(slack_api: SlackApi, fake_time: FakeTime) -> None:
    notifier = make_notifier(slack_api.api_url, fake_time)
    with pytest.raises(NotifyError, match=r"refused chat\.postMessage: HTTP 200 channel_not_found"):
        notifier.post(Message(incident="i", channel="#nowhere", title="t", body="b"))
    assert len(slack_api.requests) == 1 and fake_time.sleeps == []


# --- the token stays secret ---


def test_the_token_never_appears_in_logs_exceptions_or_repr(
    slack_api: SlackApi, fake_time: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    configured = SlackNotifier.from_env({"SLACK_BOT_TOKEN": TOKEN, "SLACK_API_URL": slack_api.api_url})
    assert configured is not None
    slack_api.fail_next(1, 429, retry_after="0")
    configured.post(MESSAGE)

    wrong_token = "xoxb-9999-wrong-tokenvalue"
    with pytest.raises(NotifyError, match="invalid_auth") as refused:
        make_notifier(slack_api.api_url, fake_time, token=wrong_token).post(MESSAGE)
    slack_api.fail_next(5, 500)
    with pytest.raises(NotifyError) as gave_up:
        make_notifier(slack_api.api_url, fake_time, max_wait_s=1).post(MESSAGE)

    assert "retry 1" in caplog.text  # the retry was logged, so the check below saw real log output
    exposed = [caplog.text, repr(configured), str(configured)]
    for error in (refused.value, gave_up.value):
        exposed += [str(error), repr(error), "".join(traceback.format_exception(error))]
    for secret in (TOKEN, wrong_token):
        assert not [text for text in exposed if secret in text]


# --- configuration ---


def test_from_env_needs_a_token_and_honours_slack_api_url(slack_api: SlackApi) -> None:
    assert SlackNotifier.from_env({}) is None
    assert SlackNotifier.from_env({"SLACK_BOT_TOKEN": ""}) is None
    configured = SlackNotifier.from_env(
        {"SLACK_BOT_TOKEN": TOKEN, "SLACK_API_URL": slack_api.api_url.rstrip("/")}
    )
    assert configured is not None
    thread = configured.post(MESSAGE)
    assert split_thread(thread)[0] == CHANNEL_ID
    assert slack_api.requests[0].headers["Authorization"] == f"Bearer {TOKEN}"


def test_current_flow_run_url_links_the_prefect_ui_only_when_known(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "0b5e")
    with temporary_settings({PREFECT_UI_URL: "http://prefect.example"}):
        assert current_flow_run_url(MESSAGE) == "http://prefect.example/flow-runs/flow-run/0b5e"
    # With no UI address and no API address to derive one from (the test harness sets an API URL).
    with temporary_settings(restore_defaults={PREFECT_UI_URL, PREFECT_API_URL}):
        assert current_flow_run_url(MESSAGE) is None


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Retry-After": "2.5"}, 2.5),
        ({"retry-after": ["3"]}, 3.0),
        ({"Retry-After": "-4"}, 0.0),
        ({"Retry-After": "soon"}, None),
        ({"Retry-After": "nan"}, None),
        ({}, None),
    ],
)
def test_retry_after_parsing(headers: dict, expected: float | None) -> None:
    assert retry_after_s(headers) == expected


@pytest.mark.parametrize("bad", ["", "C1", ":1.0", "C1:"])
def test_a_malformed_thread_reference_is_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="thread reference"):
        split_thread(bad)


# --- request signatures ---

BODY = b"payload=%7B%22type%22%3A%22block_actions%22%7D"
NOW = 1_700_000_000


def signed_headers(body: bytes, timestamp: int, secret: str = SECRET) -> dict[str, str]:
    # Slack's documented scheme, computed independently of slack-sdk: v0=HMAC-SHA256(v0:ts:body).
    base = b"v0:" + str(timestamp).encode() + b":" + body
    digest = hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()
    return {"X-Slack-Request-Timestamp": str(timestamp), "X-Slack-Signature": f"v0={digest}"}


def test_a_correctly_signed_fresh_request_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLACK_SIGNING_SECRET", SECRET)
    verify(BODY, signed_headers(BODY, NOW), now=NOW + 299)
    lowered = {k.lower(): v for k, v in signed_headers(BODY, NOW).items()}
    verify(BODY, lowered, now=NOW)


@pytest.mark.parametrize(
    ("body", "headers", "now", "match"),
    [
        (BODY + b"x", signed_headers(BODY, NOW), NOW, "does not match"),
        (BODY, signed_headers(BODY, NOW, secret="another-secret"), NOW, "does not match"),
        (BODY, signed_headers(BODY, NOW), NOW + 301, "stale.*301 s"),
        (BODY, signed_headers(BODY, NOW), NOW - 301, "stale"),
        (BODY, {}, NOW, "missing header.*timestamp, x-slack-signature"),
        (BODY, {"X-Slack-Signature": "v0=00"}, NOW, "missing header.*timestamp$"),
        (BODY, {"X-Slack-Request-Timestamp": str(NOW)}, NOW, "missing header.*x-slack-signature$"),
        (BODY, {"X-Slack-Request-Timestamp": "noon", "X-Slack-Signature": "v0=00"}, NOW, "malformed"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(
    body: bytes, headers: dict[str, str], now: int, match: str
) -> None:
    with pytest.raises(SignatureError, match=match):
        verify(body, headers, now=now, secret=SECRET)


def test_verifying_without_a_signing_secret_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLACK_SIGNING_SECRET", raising=False)
    with pytest.raises(RuntimeError, match="SLACK_SIGNING_SECRET is not set"):
        verify(BODY, signed_headers(BODY, NOW), now=NOW)


# --- approvers: Slack user ids, emails resolved once, never display names ---

ALICE = slack_user("U0ALICE1", "alice", "alice@example.com")
POLICY_WITH_APPROVERS = """\
version: 1
approvals:
  approvers: [U0CAROL1, alice@example.com, ghost@example.com, gone@example.com]
rules:
  - id: r
    description: d
    when: {xid: [79]}
    then: {classification: hardware, action: reboot}
"""


def test_user_id_by_email_asks_users_lookup_by_email_as_slack_answers(
    slack_api: SlackApi, notifier: SlackNotifier
) -> None:
    slack_api.add_user(ALICE)
    slack_api.add_user(slack_user("U0GONE01", "gone", "gone@example.com", deleted=True))
    assert notifier.user_id_by_email("Alice@example.com") == "U0ALICE1"
    assert notifier.user_id_by_email("ghost@example.com") is None  # users_not_found
    assert notifier.user_id_by_email("gone@example.com") is None  # deactivated: no approver
    lookups = [r for r in slack_api.requests if r.method == "users.lookupByEmail"]
    assert lookups[0].params == {"email": "Alice@example.com"}  # the query of a GET, as slack-sdk sends it


def test_user_id_by_email_without_the_scope_is_a_refusal(fake_time: FakeTime) -> None:
    with running_slack_api(TOKEN, {}, scopes=frozenset({"chat:write"})) as api:
        notifier = make_notifier(api.api_url, fake_time)
        with pytest.raises(NotifyError, match="missing_scope"):
            notifier.user_id_by_email("alice@example.com")


@pytest.fixture
def approving_runtime(
    slack_api: SlackApi, notifier: SlackNotifier, sqlite_store: Store, tmp_path: Path
) -> Runtime:
    slack_api.add_user(ALICE)
    slack_api.add_user(slack_user("U0GONE01", "gone", "gone@example.com", deleted=True))
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY_WITH_APPROVERS)
    backends, _ = registry.simulated()
    backends.notifier = notifier
    return Runtime(sqlite_store, backends, policy)


def test_approver_emails_are_resolved_once_and_failures_said(
    slack_api: SlackApi, approving_runtime: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="medic.runtime")
    approving_runtime.policy()  # the load starts the lookups, on a thread of their own
    first = approving_runtime.approvers(wait_s=10)
    assert first.ids == {"U0CAROL1", "U0ALICE1"}
    assert first.problems == (
        "ghost@example.com: no active Slack user has this email",
        "gone@example.com: no active Slack user has this email",
    )
    for _ in range(5):  # clicks, and the policy read again each time
        assert approving_runtime.approvers() == first
    lookups = [r.params["email"] for r in slack_api.requests if r.method == "users.lookupByEmail"]
    assert sorted(lookups) == ["alice@example.com", "ghost@example.com", "gone@example.com"]
    logged = [r.getMessage() for r in caplog.records if "ghost@example.com" in r.getMessage()]
    assert logged == [
        "approver ghost@example.com: no active Slack user has this email; nobody is let in by it"
    ]


def test_an_email_slack_cannot_be_asked_about_is_said_and_asked_again_later(
    slack_api: SlackApi, approving_runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    notifier = approving_runtime.backends.notifier
    assert isinstance(notifier, SlackNotifier)
    notifier.max_wait_s = 0  # no retries within a call: Slack is down
    monkeypatch.setattr("medic.tasks.runtime.process.APPROVER_RETRY_S", 1.0)
    slack_api.go_down(503)
    down = approving_runtime.approvers(wait_s=10)
    assert down.ids == {"U0CAROL1"} and down.retry
    assert any(
        p.startswith("alice@example.com: not resolved yet, Slack could not be asked") for p in down.problems
    )
    slack_api.come_back()
    assert approving_runtime.approvers(wait_s=10) == down  # not asked again at once
    time.sleep(1.1)
    assert approving_runtime.approvers(wait_s=10).ids == {"U0CAROL1", "U0ALICE1"}


def _click(user_id: str, username: str) -> bytes:
    value = json.dumps({"flow_run": "7b0e1f7c-43a4-4b8e-9a37-3d4f1b1e0c11", "incident": "inc-42"})
    payload = {
        "type": "block_actions",
        "user": {"id": user_id, "username": username, "name": username},
        "actions": [{"action_id": APPROVE_ACTION, "value": value, "type": "button"}],
    }
    return urlencode({"payload": json.dumps(payload)}).encode()


def test_a_click_is_matched_by_slack_user_id_never_by_display_name(
    approving_runtime: Runtime, sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLACK_SIGNING_SECRET", SECRET)
    resumed: list[dict[str, object]] = []
    callbacks = SlackCallbacks(
        approvers=lambda: approving_runtime.approvers().ids,  # as `medic serve` wires it
        resume=lambda _run, answer: resumed.append(answer),
        claim=lambda _incident, _approved, _by: (None, True),
        reopen=lambda _id: None,
    )
    approving_runtime.policy()
    app = create_app(sqlite_store, tokens={"t"}, hmac_secret=None, on_accepted=None, slack=callbacks)
    with TestClient(app) as client:

        def click(user_id: str, username: str) -> dict[str, object]:
            body = _click(user_id, username)
            answer = client.post(
                "/v1/slack/interactions", content=body, headers=signed_headers(body, int(time.time()))
            )
            assert answer.status_code == 200
            return answer.json()

        # Mallory renamed herself "alice", the approver's name: her id is not alice's.
        assert "not an approver" in str(click("U0MALLORY", "alice")["text"])
        # An email Slack does not know lets nobody in, whatever the clicker's name says.
        assert "not an approver" in str(click("U0GHOST01", "ghost")["text"])
        assert resumed == []
        assert "approved by alice" in str(click("U0ALICE1", "alice")["text"])
    assert resumed == [{"approved": True, "by": "U0ALICE1", "via": "slack"}]
