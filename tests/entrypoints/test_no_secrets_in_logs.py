"""No secret reaches a log (issue 15): `medic serve`, run as a real process with every credential it
takes, is sent authenticated, unauthenticated, query-string-token and failing requests, made to log
errors (a Slack that refuses its bot token, a store that breaks under it), then stopped; every byte it
wrote (standard output with uvicorn's access log, standard error, every file under its MEDIC_HOME and
PREFECT_HOME) is searched for each secret, and a find is named by file and line.

And `/healthz` of a store that is down names no host, database, user or path.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from checkout import TEST_FIXTURES
from factories import event_dict
from slack_api import running_slack_api
from sqlalchemy import create_engine, make_url, text
from test_server import free_port, make_app, serving

from medic.apps.server.auth import sign
from medic.integrations.slack.blocks import APPROVE_ACTION
from medic.statuses import ACTIVE_INCIDENT_STATUSES
from medic.store import Store

# Obviously fake, and unique: a find can only be a leak. By what a find is reported as.
INGEST_TOKENS = ("fake-ingest-token-one-6c1d9e02a7", "fake-ingest-token-two-3f8b5a14c9")
CREDENTIALS = {
    "MEDIC_INGEST_HMAC_SECRET": "fake-hmac-secret-a41e7c2d90",
    "MEDIC_SENTRY_CLIENT_SECRET": "fake-sentry-client-secret-5b2f8e61d3",
    "SLACK_SIGNING_SECRET": "fake-slack-signing-secret-9d04c7ab18",
    "SLACK_BOT_TOKEN": "xoxb-fake-bot-token-72e1f0c9b4",
    "PREFECT_API_KEY": "pnu_fake_prefect_api_key_0e5a93d7c2",
}
DATABASE_PASSWORD = "fake-database-password-d83b1f5e07"
SECRETS = {
    **{value: name for name, value in CREDENTIALS.items()},
    **{token: "MEDIC_INGEST_TOKENS" for token in INGEST_TOKENS},
    DATABASE_PASSWORD: "the password in MEDIC_DATABASE_URL",
}
FIXTURES = TEST_FIXTURES
MEDIC_SERVE = [sys.executable, "-c", "from medic.apps.cli.app import main; main()", "serve"]


def leaks(directories: list[Path], files: list[Path]) -> list[str]:
    """`file:line: what` for every secret in any of the files, or in any file under the directories."""
    found = []
    for path in sorted({*files, *(p for d in directories for p in d.rglob("*") if p.is_file())}):
        data = path.read_bytes()
        for value, name in SECRETS.items():
            start = data.find(value.encode())
            while start >= 0:
                line = data.count(b"\n", 0, start) + 1
                found.append(f"{path}:{line}: {name}")
                start = data.find(value.encode(), start + 1)
    return found


@dataclass
class Served:
    url: str
    database_url: str
    process: subprocess.Popen[bytes]


@pytest.fixture
def database(postgres_admin_url: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """A PostgreSQL database of its own, reached with a password, and how to drop it under the service."""
    name = f"medic_secrets_{uuid.uuid4().hex[:10]}"
    admin = create_engine(postgres_admin_url, isolation_level="AUTOCOMMIT")

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    server = make_url(postgres_admin_url)
    url = server.set(password=DATABASE_PASSWORD, database=name).render_as_string(hide_password=False)
    try:
        yield url, drop
    finally:
        drop()
        admin.dispose()


@pytest.fixture
def served(tmp_path: Path, database: tuple[str, Callable[[], None]]) -> Iterator[Served]:
    """`medic serve` with every credential; its standard output and error in files under tmp_path."""
    port = free_port()
    with running_slack_api("the-bot-token-slack-expects", {"gpu-alerts": "C0ALERTS"}) as slack:
        env = os.environ | CREDENTIALS
        env |= {
            "MEDIC_INGEST_TOKENS": ",".join(INGEST_TOKENS),
            "MEDIC_DATABASE_URL": database[0],
            "MEDIC_HOME": str(tmp_path / "medic-home"),
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "PREFECT_API_URL": "",  # the embedded server: flow runs happen, and log
            "SLACK_API_URL": slack.api_url,  # it answers `invalid_auth` to our bot token: errors that log
        }
        with (tmp_path / "stdout.log").open("wb") as out, (tmp_path / "stderr.log").open("wb") as err:
            process = subprocess.Popen(
                [*MEDIC_SERVE, "--port", str(port), "--log-level", "debug"], env=env, stdout=out, stderr=err
            )
        try:
            yield Served(f"http://127.0.0.1:{port}", database[0], process)
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


def wait_healthy(url: str, process: subprocess.Popen[bytes], query: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/healthz?{query}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert process.poll() is None, f"medic serve exited with {process.returncode}"
        assert time.monotonic() < deadline, "medic serve did not start"
        time.sleep(0.1)


def requests_with_secrets(sent_at: int) -> list[tuple[str, int, str, str, dict[str, Any]]]:
    """(what, the status it must get, method, path, httpx options): every way a secret travels."""
    token, other_token = INGEST_TOKENS
    hmac_secret, sentry_secret = (
        CREDENTIALS["MEDIC_INGEST_HMAC_SECRET"],
        CREDENTIALS["MEDIC_SENTRY_CLIENT_SECRET"],
    )
    slack_secret = CREDENTIALS["SLACK_SIGNING_SECRET"]
    bearer = {"Authorization": f"Bearer {token}"}
    when = datetime.now(UTC).isoformat()

    def fault(event_id: str, node: str) -> dict[str, Any]:
        return event_dict("xid", id=event_id, node=node, time=when)

    signed = json.dumps(fault("signed", "gpu-node-3")).encode()
    alert = json.loads((FIXTURES / "sentry" / "event_alert_nan.json").read_text(encoding="utf-8"))
    alert["data"]["event"]["tags"] = [["node", "gpu-node-4"]]
    value = json.dumps({"flow_run": "0" * 32, "incident": "inc-none"})
    click = urlencode(
        {
            "payload": json.dumps(
                {
                    "type": "block_actions",
                    "user": {"id": "U-NOBODY", "username": "stranger"},
                    "actions": [{"action_id": APPROVE_ACTION, "value": value}],
                }
            )
        }
    ).encode()
    query_secrets = f"access_token={token}&hmac={quote(hmac_secret)}&slack={slack_secret}"
    return [
        ("bearer", 200, "POST", "/v1/events", {"json": fault("bearer", "gpu-node-1"), "headers": bearer}),
        (
            "the other token",
            200,
            "POST",
            "/v1/events",
            {"json": fault("other", "gpu-node-2"), "headers": {"Authorization": f"Bearer {other_token}"}},
        ),
        (
            "hmac",
            200,
            "POST",
            "/v1/events",
            {"content": signed, "headers": {"X-Medic-Signature": sign(signed, hmac_secret.encode())}},
        ),
        (
            "invalid items",
            422,
            "POST",
            "/v1/events",
            {"content": b'{"id": "x"}\nnot json\n', "headers": bearer},
        ),
        ("no credentials", 401, "POST", "/v1/events", {"json": fault("nope", "gpu-node-1")}),
        (
            "a secret as the token",
            401,
            "POST",
            "/v1/events",
            {"json": {}, "headers": {"Authorization": f"Bearer {hmac_secret}"}},
        ),
        (
            "secrets in the query",
            200,
            "POST",
            f"/v1/events?{query_secrets}",
            {"json": fault("query", "gpu-node-5"), "headers": bearer},
        ),
        ("secrets in the query, no credentials", 401, "POST", f"/v1/events?{query_secrets}", {"json": {}}),
        ("a bot token in the query", 200, "GET", f"/metrics?bot={CREDENTIALS['SLACK_BOT_TOKEN']}", {}),
        ("sentry", 200, "POST", "/v1/sentry", _sentry(alert, sentry_secret, sent_at)),
        (
            "sentry, wrong secret",
            401,
            "POST",
            f"/v1/sentry?s={sentry_secret}",
            _sentry(alert, "guess", sent_at),
        ),
        ("sentry, stale", 401, "POST", "/v1/sentry", _sentry(alert, sentry_secret, sent_at - 3600)),
        # A click for a flow run that is not there: answered 200 with the failure, which serve logs.
        ("slack click", 200, "POST", "/v1/slack/interactions", _slack(click, slack_secret, sent_at)),
        ("slack, wrong secret", 401, "POST", "/v1/slack/interactions", _slack(click, "guess", sent_at)),
        ("slack, unsigned", 401, "POST", f"/v1/slack/interactions?secret={slack_secret}", {"content": click}),
    ]


def _sentry(body: dict[str, Any], secret: str, sent_at: float) -> dict[str, Any]:
    raw = json.dumps(body).encode()
    headers = {
        "Content-Type": "application/json",
        "Sentry-Hook-Resource": "event_alert",
        "Sentry-Hook-Timestamp": str(int(sent_at)),
        "Sentry-Hook-Signature": hmac.new(secret.encode(), raw, hashlib.sha256).hexdigest(),
    }
    return {"content": raw, "headers": headers}


def _slack(body: bytes, secret: str, sent_at: int) -> dict[str, Any]:
    base = b"v0:" + str(sent_at).encode() + b":" + body
    headers = {
        "Content-Type": "application/x-www-form-urlencoded",
        "X-Slack-Request-Timestamp": str(sent_at),
        "X-Slack-Signature": "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest(),
    }
    return {"content": body, "headers": headers}


def settled(database_url: str, timeout_s: float) -> list[str]:
    """The statuses of the incidents, once none is being handled (their flow runs have logged)."""
    store = Store(database_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with store.session() as s:
                statuses = list(s.exec(text("SELECT status FROM incidents")).scalars())
            if statuses and not set(statuses) & ACTIVE_INCIDENT_STATUSES:
                return statuses
            assert time.monotonic() < deadline, f"incidents still being handled: {statuses}"
            time.sleep(0.5)
    finally:
        store.close()


def test_no_secret_reaches_any_log_of_medic_serve(
    tmp_path: Path, served: Served, database: tuple[str, Callable[[], None]]
) -> None:
    hmac_secret = CREDENTIALS["MEDIC_INGEST_HMAC_SECRET"]
    wait_healthy(served.url, served.process, f"token={INGEST_TOKENS[0]}&secret={hmac_secret}")
    with httpx.Client(base_url=served.url, timeout=30) as client:
        answers = {
            what: (expected, client.request(method, path, **options).status_code)
            for what, expected, method, path, options in requests_with_secrets(int(time.time()))
        }
        assert settled(served.database_url, 120)  # flow runs met a Slack refusing the bot token: logged
        _, drop = database
        drop()  # the store goes away under the service: /healthz, the ingest and the warm path log why
        down = client.get("/healthz")
        broken = client.post(
            "/v1/events",
            json=event_dict("xid", id="after"),
            headers={"Authorization": f"Bearer {INGEST_TOKENS[0]}"},
        )
    served.process.send_signal(signal.SIGTERM)
    served.process.wait(timeout=30)
    assert {what: got for what, (_, got) in answers.items()} == {
        what: want for what, (want, _) in answers.items()
    }
    assert (down.status_code, broken.status_code) == (503, 503)  # the ingest asks to send again (0014)
    database_name = make_url(served.database_url).database or ""
    for answer in (down, broken):  # the store's failure is named in the log only
        assert database_name not in answer.text and "127.0.0.1" not in answer.text
    logs = [tmp_path / "stdout.log", tmp_path / "stderr.log"]
    written = "".join(path.read_text(errors="replace") for path in logs)
    assert "/v1/events?access_token=***" in written  # the access log was written, its values hidden
    assert "invalid_auth" in written  # the Slack failure was logged
    assert database_name in written  # and so was the store's failure, naming it
    found = leaks([tmp_path / "medic-home", tmp_path / "prefect-home"], logs)
    assert not found, "secrets in the logs:\n" + "\n".join(found)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_healthz_names_no_host_database_user_or_password_when_postgresql_is_down(
    postgres_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    password = "fake-database-password-1b9e"
    working = postgres_store.engine
    # The store's server stops answering: nothing listens on port 9 here.
    postgres_store.engine = create_engine(
        f"postgresql+psycopg://medic_user_x:{password}@127.0.0.1:9/medic_database_x",
        connect_args={"connect_timeout": 2},
    )
    try:
        with caplog.at_level(logging.WARNING, logger="medic.apps.server"):
            async with serving(make_app(postgres_store)) as client:
                down = await client.get("/healthz")
    finally:
        postgres_store.engine.dispose()
        postgres_store.engine = working
    assert down.status_code == 503
    assert down.json() == {"status": "unavailable", "error": "the store does not answer (OperationalError)"}
    for secret in ("127.0.0.1", "medic_user_x", "medic_database_x", password):
        assert secret not in down.text
    assert "127.0.0.1" in caplog.text  # the reason goes to serve's log
    assert password not in caplog.text
