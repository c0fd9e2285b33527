"""A local stand-in for Slack's Web API server (chat.postMessage, chat.update, auth.test,
users.lookupByEmail) for slack-sdk to talk to.

slack-sdk ships no mock server, so this answers over real HTTP on 127.0.0.1 the way Slack does: bearer-token
auth, channel names resolved to ids, increasing message timestamps, thread replies that keep thread_ts,
users found by email (GET, as slack-sdk sends it; `users_not_found` otherwise), and on request HTTP 429
with Retry-After or HTTP 5xx for the next calls, or for every call until it comes back. Every request is
recorded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

API_PREFIX = "/api/"
BASE_TS = 1_700_000_000


@dataclass(frozen=True, slots=True)
class Recorded:
    method: str
    headers: dict[str, str]
    params: dict[str, Any]
    status: int  # what the server answered


@dataclass(frozen=True, slots=True)
class Failure:
    status: int
    retry_after: str | None


@dataclass
class SlackState:
    token: str
    channels: dict[str, str]  # name → id
    users: dict[str, dict[str, Any]] = field(default_factory=dict)  # email → Slack's user object
    scopes: frozenset[str] = frozenset({"chat:write", "users:read", "users:read.email"})
    down: Failure | None = None  # answer every call with this until it comes back
    requests: list[Recorded] = field(default_factory=list)
    messages: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (channel id, ts) →
    failures: list[Failure] = field(default_factory=list)
    posted: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _params(content_type: str, raw: bytes) -> dict[str, Any]:
    """The call's arguments as slack-sdk sends them: a JSON body, or a form whose blocks are a JSON string."""
    if content_type.startswith("application/json"):
        return json.loads(raw or b"{}")
    params: dict[str, Any] = dict(parse_qsl(raw.decode()))
    if isinstance(params.get("blocks"), str):
        params["blocks"] = json.loads(params["blocks"])
    return params


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        self._handle(url.path.removeprefix(API_PREFIX), dict(parse_qsl(url.query)))

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        params = _params(self.headers.get("Content-Type", ""), raw)
        self._handle(self.path.split("?")[0].removeprefix(API_PREFIX), params)

    def _handle(self, method: str, params: dict[str, Any]) -> None:
        state = self.server.state
        with state.lock:
            failure = state.failures.pop(0) if state.failures else state.down
            answer = None if failure else _answer(state, method, self.headers.get("Authorization"), params)
            status = failure.status if failure else 200
            state.requests.append(Recorded(method, dict(self.headers.items()), params, status))
        if failure is None:
            self._send(200, json.dumps(answer).encode(), "application/json", None)
        elif failure.status == 429:
            body = json.dumps({"ok": False, "error": "ratelimited"}).encode()
            self._send(429, body, "application/json", failure.retry_after)
        else:  # Slack's 5xx pages are not JSON
            self._send(failure.status, b"<html>internal error</html>", "text/html", failure.retry_after)

    def _send(self, status: int, payload: bytes, content_type: str, retry_after: str | None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", f"{content_type}; charset=utf-8")
        self.send_header("Content-Length", str(len(payload)))
        if retry_after is not None:
            self.send_header("Retry-After", retry_after)
        self.end_headers()
        self.wfile.write(payload)


def _answer(state: SlackState, method: str, auth: str | None, params: dict[str, Any]) -> dict[str, Any]:
    if not auth:
        return {"ok": False, "error": "not_authed"}
    if auth != f"Bearer {state.token}":
        return {"ok": False, "error": "invalid_auth"}
    if method == "chat.postMessage":
        return _post(state, params)
    if method == "chat.update":
        return _update(state, params)
    if method == "auth.test":
        return {"ok": True, "url": "https://medic-test.slack.com/", "team": "medic-test", "user": "medic"}
    if method == "users.lookupByEmail":
        return _lookup_by_email(state, params)
    return {"ok": False, "error": "unknown_method"}


def _lookup_by_email(state: SlackState, params: dict[str, Any]) -> dict[str, Any]:
    # As documented at docs.slack.dev/reference/methods/users.lookupByEmail: the scope first, then
    # the user (a deactivated one is still found, with `deleted: true`), else `users_not_found`.
    if "users:read.email" not in state.scopes:
        provided = ",".join(sorted(state.scopes))
        return {"ok": False, "error": "missing_scope", "needed": "users:read.email", "provided": provided}
    if not params.get("email"):
        return {"ok": False, "error": "invalid_arguments"}
    user = state.users.get(str(params["email"]).lower())
    if user is None:
        return {"ok": False, "error": "users_not_found"}
    return {"ok": True, "user": user}


def slack_user(user_id: str, name: str, email: str, deleted: bool = False) -> dict[str, Any]:
    """A user object as users.lookupByEmail returns it (the fields Slack documents, trimmed)."""
    return {
        "id": user_id,
        "team_id": "T0MEDIC",
        "name": name,
        "deleted": deleted,
        "real_name": name.title(),
        "is_bot": False,
        "profile": {"display_name": name, "real_name": name.title(), "email": email},
    }


def _post(state: SlackState, params: dict[str, Any]) -> dict[str, Any]:
    name = str(params.get("channel", "")).removeprefix("#")
    channel = state.channels.get(name, name)
    if channel not in state.channels.values():
        return {"ok": False, "error": "channel_not_found"}
    if not params.get("text") and not params.get("blocks"):
        return {"ok": False, "error": "no_text"}
    state.posted += 1
    ts = f"{BASE_TS + state.posted}.{state.posted:06d}"
    message = {
        "type": "message",
        "ts": ts,
        "text": params.get("text", ""),
        "blocks": params.get("blocks", []),
    }
    if params.get("thread_ts"):
        message["thread_ts"] = params["thread_ts"]
    state.messages[(channel, ts)] = message
    return {"ok": True, "channel": channel, "ts": ts, "message": message}


def _update(state: SlackState, params: dict[str, Any]) -> dict[str, Any]:
    # Like Slack, chat.update takes only a channel id, not a name.
    key = (str(params.get("channel", "")), str(params.get("ts", "")))
    if key[0] not in state.channels.values():
        return {"ok": False, "error": "channel_not_found"}
    if key not in state.messages:
        return {"ok": False, "error": "message_not_found"}
    message = state.messages[key]
    message.update(text=params.get("text", ""), blocks=params.get("blocks", []), edited=True)
    return {"ok": True, "channel": key[0], "ts": key[1], "text": message["text"], "message": message}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: SlackState) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state


class SlackApi:
    """The running server: `api_url` is what WebClient(base_url=...) needs."""

    def __init__(self, server: _Server) -> None:
        self._server = server

    @property
    def api_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}{API_PREFIX}"

    @property
    def requests(self) -> list[Recorded]:
        with self._server.state.lock:
            return list(self._server.state.requests)

    def message(self, channel: str, ts: str) -> dict[str, Any]:
        with self._server.state.lock:
            return dict(self._server.state.messages[(channel, ts)])

    def posted(self, channel: str) -> list[dict[str, Any]]:
        """The messages in a channel (by id), thread replies included, in the order Slack took them."""
        with self._server.state.lock:
            return [dict(m) for (c, _), m in self._server.state.messages.items() if c == channel]

    def fail_next(self, count: int, status: int = 429, retry_after: str | None = None) -> None:
        """Answer the next `count` calls with `status` (429 or 5xx), with a Retry-After header if given."""
        with self._server.state.lock:
            self._server.state.failures.extend(Failure(status, retry_after) for _ in range(count))

    def go_down(self, status: int = 503, retry_after: str | None = None) -> None:
        """Answer every call with `status` until `come_back`."""
        with self._server.state.lock:
            self._server.state.down = Failure(status, retry_after)

    def come_back(self) -> None:
        with self._server.state.lock:
            self._server.state.down = None

    def add_user(self, user: dict[str, Any]) -> None:
        with self._server.state.lock:
            self._server.state.users[user["profile"]["email"].lower()] = user


@contextmanager
def running_slack_api(
    token: str, channels: Mapping[str, str], scopes: frozenset[str] | None = None
) -> Iterator[SlackApi]:
    state = SlackState(token=token, channels=dict(channels))
    if scopes is not None:
        state.scopes = scopes
    server = _Server(state)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="slack-api", daemon=True
    )
    thread.start()
    try:
        yield SlackApi(server)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
