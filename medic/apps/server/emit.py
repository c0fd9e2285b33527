"""`medic emit`: post events to a running `medic serve` (docs/serve.md)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx

from medic.apps.server import DEFAULT_HOST, DEFAULT_PORT
from medic.events import event_time

DEFAULT_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
URL_ENV = "MEDIC_URL"
TOKEN_ENV = "MEDIC_TOKEN"
EVENTS_PATH = "/v1/events"


def parse_attribute(pair: str) -> tuple[str, Any]:
    """`key=value`, the value read as JSON when it is JSON (`code=79` is the number 79)."""
    key, sep, value = pair.partition("=")
    if not sep or not key:
        raise ValueError(f"expected key=value, got {pair!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def build_event(
    *,
    kind: str,
    node: str,
    source: str,
    event_id: str | None = None,
    time: str | None = None,
    attributes: dict[str, Any] | None = None,
    **envelope: str | int | None,
) -> dict[str, Any]:
    """One event; `envelope` holds the optional fields (gpu, job, rank, ...), None meaning absent.

    The server validates it: this only fills in the defaults (a fresh id, the time now).
    """
    event: dict[str, Any] = {
        "id": event_id or str(uuid.uuid4()),
        "time": time or event_time(datetime.now(UTC)),
        "source": source,
        "kind": kind,
        "node": node,
    }
    event.update({name: value for name, value in envelope.items() if value is not None})
    event["attributes"] = attributes or {}
    return event


def post_events(
    url: str, token: str, body: bytes, content_type: str, timeout_s: float = 30.0
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": content_type}
    return httpx.post(url.rstrip("/") + EVENTS_PATH, content=body, headers=headers, timeout=timeout_s)
