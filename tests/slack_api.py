"""A local stand-in for Slack's Web API server (chat.postMessage, chat.update, auth.test) for slack-sdk to talk to.

slack-sdk ships no mock server, so this answers over real HTTP on 127.0.0.1 the way Slack does: bearer-token
auth, channel names resolved to ids, increasing message timestamps, thread replies that keep thread_ts,
and on request HTTP 429 with Retry-After or HTTP 500 for the next calls. Every request is recorded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl

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

    def do_POST(self) -> None:
        state = self.server.state
        method = self.path.split("?")[0].removeprefix(API_PREFIX)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        params = _params(self.headers.get("Content-Type", ""), raw)
        with state.lock:
            failure = state.failures.pop(0) if state.failures else None
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
    return {"ok": False, "error": "unknown_method"}


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

    def fail_next(self, count: int, status: int = 429, retry_after: str | None = None) -> None:
        """Answer the next `count` calls with `status` (429 or 5xx), with a Retry-After header if given."""
        with self._server.state.lock:
            self._server.state.failures.extend(Failure(status, retry_after) for _ in range(count))


@contextmanager
def running_slack_api(token: str, channels: Mapping[str, str]) -> Iterator[SlackApi]:
    server = _Server(SlackState(token=token, channels=dict(channels)))
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
