"""CloudEvents 1.0 structured mode (JSON) to our event envelope.

`type` is the event kind (`xid`, or `medic.fault.xid`); `source`, `id` and `time` are the
CloudEvent's own; `data` holds the rest of the envelope: node, gpu, job, rank, iteration,
switch and attributes. Other CloudEvents attributes (subject, datacontenttype, extensions)
say nothing our schema keeps, so they are dropped.
"""

from __future__ import annotations

from typing import Any

SPEC_VERSION = "1.0"
TYPE_PREFIX = "medic.fault."
# Envelope fields that come from the CloudEvent's own attributes, never from `data`.
_FROM_ATTRIBUTES = {"id": "id", "source": "source", "time": "time", "kind": "type"}


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
