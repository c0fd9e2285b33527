"""Checking that an HTTP request really comes from Slack (interactive callbacks), before acting on it.

slack-sdk's SignatureVerifier only answers yes or no; the checks for missing headers and stale timestamps
are made here first so that the refusal says which one failed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from slack_sdk.signature import Clock, SignatureVerifier

from medic.errors import PermanentError

SECRET_ENV = "SLACK_SIGNING_SECRET"
TIMESTAMP_HEADER = "x-slack-request-timestamp"
SIGNATURE_HEADER = "x-slack-signature"
# Slack's advice, and what SignatureVerifier enforces: older requests may be replays.
MAX_AGE_S = 300


class SignatureError(PermanentError, ValueError):
    """Raised when the request is not a fresh, correctly signed request from Slack; answer it with 401."""


class _FixedClock(Clock):
    def __init__(self, now: float) -> None:
        self._now = now

    def now(self) -> float:
        return self._now


def signing_secret(env: Mapping[str, str] | None = None) -> str:
    secret = (os.environ if env is None else env).get(SECRET_ENV, "")
    if not secret.strip():
        raise RuntimeError(f"{SECRET_ENV} is not set: Slack requests cannot be verified")
    return secret


def check_headers(headers: Mapping[str, str], now: float | None = None) -> dict[str, str]:
    """Raises SignatureError unless the signature headers are there and the timestamp is fresh: what
    can be refused before the body is read. Returns the headers with lower-case names."""
    lowered = {name.lower(): value for name, value in headers.items()}
    missing = [name for name in (TIMESTAMP_HEADER, SIGNATURE_HEADER) if not lowered.get(name)]
    if missing:
        raise SignatureError(f"not signed by Slack: missing header(s) {', '.join(missing)}")
    stamp = lowered[TIMESTAMP_HEADER]
    try:
        sent_at = int(stamp)
    except ValueError:
        raise SignatureError(f"malformed {TIMESTAMP_HEADER}: {stamp[:40]!r}") from None
    now = time.time() if now is None else now
    if abs(now - sent_at) > MAX_AGE_S:
        raise SignatureError(
            f"stale request: its timestamp is {abs(now - sent_at):.0f} s from now, more than {MAX_AGE_S} s "
            "(a replay, or clock skew)"
        )
    return lowered


def verify(
    body: bytes, headers: Mapping[str, str], now: float | None = None, *, secret: str | None = None
) -> None:
    """Raises SignatureError unless `body` and `headers` are a request Slack signed with the app's signing
    secret (`secret`, else SLACK_SIGNING_SECRET) less than MAX_AGE_S seconds before `now`."""
    key = secret if secret is not None else signing_secret()
    now = time.time() if now is None else now
    lowered = check_headers(headers, now)
    stamp = lowered[TIMESTAMP_HEADER]
    # slack-sdk decodes the body as UTF-8 and would raise on any other bytes: Slack sends ASCII forms.
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        raise SignatureError("the body is not UTF-8 text: not from Slack") from None
    verifier = SignatureVerifier(key, clock=_FixedClock(now))
    if not verifier.is_valid(body=body, timestamp=stamp, signature=lowered[SIGNATURE_HEADER]):
        raise SignatureError("signature does not match the body: not from Slack, or altered on the way")
