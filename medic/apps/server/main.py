"""Running the ingest app under uvicorn, configured from the environment (docs/serve.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType

import uvicorn

from medic.alerts import load_alert_map
from medic.apps.server import DEFAULT_HOST, DEFAULT_PORT, redact, sentry
from medic.apps.server.app import OnAccepted, OnStart, create_app
from medic.apps.server.auth import HMAC_SECRET_ENV, TOKENS_ENV, credentials_from_env
from medic.apps.server.slack import SlackCallbacks
from medic.config import load_settings
from medic.policy import PolicyError
from medic.store import Store


class ServeConfigError(Exception):
    pass


def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    on_accepted: OnAccepted | None = None,
    slack: SlackCallbacks | None = None,
    log_level: str = "info",
    access_log: bool = True,
    env: Mapping[str, str] | None = None,
    on_start: OnStart | None = None,
    on_stop: Callable[[], object] | None = None,
) -> None:
    """Serve until interrupted. The store is MEDIC_DATABASE_URL; credentials MEDIC_INGEST_*, and
    MEDIC_SENTRY_CLIENT_SECRET for `POST /v1/sentry`; MEDIC_ALERT_MAP extends `POST /v1/alertmanager`'s
    mapping. `on_stop` runs when a signal stops it, just before the process ends."""
    env = os.environ if env is None else env
    tokens, secret = credentials_from_env(env)
    sentry_secret = sentry.secret_from_env(env)
    try:
        sentry_options = sentry.Options.from_env(env)
        alert_map = load_alert_map(env)  # a broken MEDIC_ALERT_MAP stops the start, at its file:line
    except (ValueError, PolicyError) as error:
        raise ServeConfigError(str(error)) from None
    if not tokens and secret is None and sentry_secret is None:
        # An open ingest endpoint would let anyone trigger node reboots: refuse to start.
        raise ServeConfigError(
            f"set {TOKENS_ENV} (comma-separated tokens), {HMAC_SECRET_ENV} or {sentry.SECRET_ENV}"
        )
    store = Store(load_settings(env).database_url)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again with the handler it
    # found. Left at the default, that kills the process without running atexit hooks, and
    # Prefect's embedded API server, stopped by one, would outlive us.
    signal.signal(signal.SIGTERM, _exit)
    try:
        app = create_app(
            store,
            tokens=tokens,
            hmac_secret=secret,
            on_accepted=on_accepted,
            slack=slack,
            sentry_secret=sentry_secret,
            sentry_options=sentry_options,
            on_start=on_start,
            alert_map=alert_map,
        )
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=access_log,
            timeout_graceful_shutdown=GRACEFUL_S,
        )
        # Flow runs (the warm path) are threads of this process, and a busy thread keeps the GIL
        # for the switch interval (5 ms by default) whenever the event loop wants it: a webhook
        # needs several turns, so under 8 running flows a burst of 40 waited seconds. 1 ms.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        redact.install()  # after uvicorn.Config, which configures uvicorn's loggers
        _Server(config, on_stop).run()
    finally:
        store.close()


# Stopping on SIGTERM or Ctrl-C, within 10 s in all: requests in flight are answered (at
# most GRACEFUL_S), queued batches handed on (app.HAND_ON_GRACE_S), child processes (Prefect's
# embedded API server) terminated (CHILDREN_S, then killed), then the process ends at once.
GRACEFUL_S = 3
CHILDREN_S = 3.0
SWITCH_INTERVAL_S = 0.001


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], object] | None) -> None:
        super().__init__(config)
        self.on_stop = on_stop

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self._captured_signals:
            # Flow runs still going are on worker threads that cannot be cancelled, and the event
            # loop's close would wait for every one of them (minutes, retrying a Prefect API
            # that is gone). Everything they did is in the store: the next start resumes their
            # incidents (docs/serve.md), so end here, as after `kill -9`, minus the children.
            if self.on_stop is not None:
                self.on_stop()
            _stop_now(128 + self._captured_signals[-1])


def _stop_now(status: int) -> None:
    _end_children(CHILDREN_S)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _end_children(grace_s: float) -> None:
    """SIGTERM to every child process, SIGKILL to those still there after `grace_s`."""
    children = children_of(os.getpid())
    for pid in children:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while children and time.monotonic() < deadline:
        time.sleep(0.05)
        children = [pid for pid in children if _reap(pid)]
    for pid in children:
        _signal(pid, signal.SIGKILL)
        _reap(pid)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _reap(pid: int) -> bool:
    """True while the child is still running (and reap it once it is not)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not ours to wait for, or already reaped
        return Path(f"/proc/{pid}").exists()
    return done == 0


def _exit(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
