"""Running the ingest app under uvicorn, configured from the environment (docs/serve.md)."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from types import FrameType

import uvicorn

from apps.server import DEFAULT_HOST, DEFAULT_PORT, sentry
from apps.server.app import OnAccepted, create_app
from apps.server.auth import HMAC_SECRET_ENV, TOKENS_ENV, credentials_from_env
from apps.server.slack import SlackCallbacks
from medic.config import load_settings
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
) -> None:
    """Serve until interrupted. The store is MEDIC_DATABASE_URL; credentials MEDIC_INGEST_*, and
    MEDIC_SENTRY_CLIENT_SECRET for `POST /v1/sentry`."""
    env = os.environ if env is None else env
    tokens, secret = credentials_from_env(env)
    sentry_secret = sentry.secret_from_env(env)
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
        )
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log)
    finally:
        store.close()


def _exit(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
