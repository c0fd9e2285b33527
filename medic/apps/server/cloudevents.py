"""CloudEvents 1.0 (JSON event format, HTTP protocol binding) to our event envelope.

`type` is the event kind (`xid`, or `medic.fault.xid`); `source`, `id` and `time` are the
CloudEvent's own; `data` holds the rest of the envelope: node, gpu, job, rank, iteration,
switch and attributes. Other CloudEvents attributes (subject, datacontenttype, extensions)
say nothing our schema keeps, so they are dropped.

All three content modes of the HTTP binding are read: structured (`application/cloudevents+json`),
batched (`application/cloudevents-batch+json`) and binary, where the attributes travel as
`ce-*` headers and the body is `data` (`binary_event` turns those into the structured form).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

SPEC_VERSION = "1.0"
TYPE_PREFIX = "medic.fault."
HEADER_PREFIX = "ce-"
# Envelope fields that come from the CloudEvent's own attributes, never from `data`.
_FROM_ATTRIBUTES = {"id": "id", "source": "source", "time": "time", "kind": "type"}
# Binary mode: required by CloudEvents (specversion, id, source, type), and by our schema (time).
BINARY_REQUIRED = ("specversion", "id", "source", "type", "time")
# Media types whose body is JSON `data` (RFC 6839 `+json` suffixes included); none means JSON.
_JSON_MEDIA = re.compile(r"application/(?:[\w.-]{1,100}\+)?json")
_PERCENT = re.compile(r"%([0-9A-Fa-f]{2})")


def is_cloudevent(payload: Any) -> bool:
    return isinstance(payload, dict) and "specversion" in payload


def to_envelope(event: Any) -> dict[str, Any]:
    """Our envelope for one structured-mode CloudEvent; ValueError names the offending field."""
    if not isinstance(event, dict):
        raise ValueError(f"expected a CloudEvent object, got {type(event).__name__}")
    if "specversion" not in event:
        raise ValueError("specversion: Field required")
    if event["specversion"] != SPEC_VERSION:
        raise ValueError(f"specversion: only {SPEC_VERSION!r} is supported, got {event['specversion']!r}")
    for required in ("id", "source", "type"):
        if required not in event:
            raise ValueError(f"{required}: Field required (a CloudEvents attribute)")
    if "data_base64" in event:
        raise ValueError("data_base64: binary data is not supported, send `data` as a JSON object")
    data = event.get("data", {})
    if not isinstance(data, dict):
        raise ValueError(f"data: expected a JSON object, got {type(data).__name__}")
    envelope = dict(data)
    for field, attribute in _FROM_ATTRIBUTES.items():
        if field in data:
            raise ValueError(f"data.{field}: set by the CloudEvent's `{attribute}` attribute, not in data")
        if attribute in event:  # only `time` may be missing: then the schema reports it
            envelope[field] = event[attribute]
    kind = envelope.get("kind")
    if isinstance(kind, str):
        envelope["kind"] = kind.removeprefix(TYPE_PREFIX)
    return envelope


def binary_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The `ce-*` headers of a request, by attribute name (`ce-id` -> `id`); empty if none."""
    return {
        name.lower().removeprefix(HEADER_PREFIX): value
        for name, value in headers
        if name.lower().startswith(HEADER_PREFIX)
    }


def binary_event(attributes: dict[str, str], body: str, content_type: str | None) -> dict[str, Any]:
    """The structured-mode CloudEvent of a binary-mode request: `ce-*` headers and the body as data.

    ValueError names the header that is missing or wrong (`ce-id: ...`), or the body's problem.
    """
    decoded = {name: _header_value(name, value) for name, value in attributes.items()}
    for name in BINARY_REQUIRED:
        if not decoded.get(name):
            why = "required by CloudEvents" if name != "time" else "our events need a time"
            raise ValueError(f"{HEADER_PREFIX}{name}: header missing in binary mode ({why})")
    if decoded["specversion"] != SPEC_VERSION:
        raise ValueError(
            f"{HEADER_PREFIX}specversion: only {SPEC_VERSION!r} is supported, got {decoded['specversion']!r}"
        )
    if "datacontenttype" in decoded:
        raise ValueError(
            f"{HEADER_PREFIX}datacontenttype: must not be sent in binary mode; Content-Type carries it"
        )
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media and not _JSON_MEDIA.fullmatch(media):
        raise ValueError(
            f"content-type: binary-mode data must be a JSON object (application/json), got {media}"
        )
    try:
        data = json.loads(body) if body.strip() else {}
    except (ValueError, RecursionError) as error:
        raise ValueError(f"data (the body): not JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"data (the body): expected a JSON object, got {type(data).__name__}")
    event: dict[str, Any] = dict(decoded)
    if media:
        event["datacontenttype"] = content_type
    event["data"] = data
    return event


def _header_value(name: str, value: str) -> str:
    """An attribute from its header: quoted-string unescaped, then one round of percent-decoding.

    The HTTP binding, 3.1.3.2: decoding must accept lower-case hex and unnecessary escapes, and
    must reject byte sequences that are not valid UTF-8.
    """
    # Starlette gives header bytes as latin-1: back to the bytes, which must be ASCII here.
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = re.sub(r"\\(.)", r"\1", value[1:-1])
    raw = _PERCENT.sub(lambda found: chr(int(found[1], 16)), value)
    try:
        return raw.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise ValueError(f"{HEADER_PREFIX}{name}: not valid percent-encoded UTF-8: {value[:100]!r}") from None
