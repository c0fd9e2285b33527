"""Who may post events: a bearer token (or, where a sender has only basic auth, a token as its
password), or an HMAC-SHA256 signature of the exact body."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SIGNATURE_HEADER = "X-Medic-Signature"
TOKENS_ENV = "MEDIC_INGEST_TOKENS"
HMAC_SECRET_ENV = "MEDIC_INGEST_HMAC_SECRET"


def sign(body: bytes, secret: bytes) -> str:
    """The `X-Medic-Signature` value for a body: `sha256=<hex>`."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class Auth:
    # Tokens are kept as digests so every comparison is over 32 bytes: no length leaks.
    token_digests: frozenset[bytes]
    hmac_secret: bytes | None

    @classmethod
    def of(cls, tokens: Iterable[str], hmac_secret: bytes | None) -> Auth:
        return cls(frozenset(_digest(t) for t in tokens if t), hmac_secret or None)

    def bearer_ok(self, authorization: str | None) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        offered = _digest(token.strip())
        # Compare against every token, never stopping early, so timing says nothing about which.
        return any([hmac.compare_digest(offered, known) for known in self.token_digests])

    def basic_ok(self, authorization: str | None) -> bool:
        """HTTP basic auth whose password is an ingest token, whatever the user name: what a sender
        that cannot set a bearer token sends (Alertmanager's `http_config.basic_auth`)."""
        scheme, _, encoded = (authorization or "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return False
        _user, colon, password = decoded.partition(":")
        return bool(colon) and self.bearer_ok(f"Bearer {password}")

    def signature_ok(self, signature: str | None, body: bytes) -> bool:
        if self.hmac_secret is None or not signature:
            return False
        return hmac.compare_digest(signature.strip().encode(), sign(body, self.hmac_secret).encode())


def credentials_from_env(env: Mapping[str, str]) -> tuple[set[str], bytes | None]:
    """The tokens in MEDIC_INGEST_TOKENS (comma-separated) and the MEDIC_INGEST_HMAC_SECRET."""
    tokens = {t.strip() for t in env.get(TOKENS_ENV, "").split(",") if t.strip()}
    return tokens, env.get(HMAC_SECRET_ENV, "").encode() or None
