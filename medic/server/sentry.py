"""Sentry webhooks to fault events (`POST /v1/sentry`, docs/serve.md#sentry).

Training jobs report their exceptions to Sentry, tagged with where they ran (node, job, rank,
GPU, iteration). A Sentry internal integration forwards each error or issue alert here; the
exception's text says what kind of fault it is, by the first matching row of `KINDS`. An
event that names no node, or whose exception matches no row, goes to the dead letter with the
reason: it is kept, never guessed at.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from medic.events import EventKind
from medic.intake import Rejection, parse_line
from medic.server.decode import Decoded

SECRET_ENV = "MEDIC_SENTRY_CLIENT_SECRET"
SIGNATURE_HEADER = "Sentry-Hook-Signature"
RESOURCE_HEADER = "Sentry-Hook-Resource"
# The resources that carry one error event with its tags; the rest (issue, comment,
# installation, metric_alert) are acknowledged and ignored.
EVENT_RESOURCES = {"event_alert": "event", "error": "error"}
NODE_TAGS = ("node", "host", "hostname", "server_name")
JOB_TAGS = ("job", "job_id", "slurm_job_id")


@dataclass(frozen=True, slots=True)
class Kind:
    pattern: re.Pattern[str]
    kind: EventKind
    meaning: str


def _kind(pattern: str, kind: EventKind, meaning: str) -> Kind:
    return Kind(re.compile(pattern, re.IGNORECASE), kind, meaning)


# Most specific first: a CUDA error that names its XID is that XID, not a generic crash.
KINDS = (
    _kind(r"\bxid\b(?:\s*\([^)]*\))?\s*[:#=]?\s*(\d{1,3})\b", EventKind.XID, "an NVIDIA XID and its number"),
    _kind(r"uncorrectable ecc|double[- ]bit ecc|ecc error", EventKind.ECC, "an uncorrectable ECC error"),
    _kind(
        r"watchdog caught collective operation timeout|collective operation timeout|nccl.*time[d ]?out"
        r"|DistBackendError",
        EventKind.NCCL_TIMEOUT,
        "the NCCL watchdog or a collective timing out",
    ),
    _kind(
        r"loss is (nan|inf)|nan loss|non-finite loss|loss (became|is) non-finite|FloatingPointError",
        EventKind.NAN_LOSS,
        "a NaN or infinite loss",
    ),
    _kind(
        r"cuda error|illegal memory access|CUBLAS_STATUS|CUDNN_STATUS|cudaError",
        EventKind.JOB_CRASH,
        "any other CUDA error: the job crashed",
    ),
)


def signature_ok(secret: bytes, body: bytes, signature: str | None) -> bool:
    """Sentry signs the exact body with the integration's client secret: HMAC-SHA256, hex."""
    if not signature:
        return False
    expected = hmac.new(secret, body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(signature.strip().encode(), expected.encode())


@dataclass(frozen=True, slots=True)
class Translated:
    decoded: Decoded
    ignored: str | None = None  # why nothing was taken from an authentic webhook


def translate(body: bytes, resource: str | None, remote: str) -> Translated:
    """One Sentry webhook body to at most one fault event (or its rejection)."""
    origin = f"sentry:{remote}:{resource or '-'}"
    text = body.decode("utf-8", errors="replace")
    decoded = Decoded()
    field = EVENT_RESOURCES.get(resource or "")
    if field is None:
        return Translated(decoded, f"resource {resource or '(none)'} carries no error event; nothing to do")
    try:
        payload = json.loads(text)
        event = payload["data"][field]
        if not isinstance(event, dict):
            raise TypeError(f"data.{field} is not an object")
    except (ValueError, KeyError, TypeError) as error:
        decoded.reject(Rejection(origin, text[:1000], f"not a Sentry {resource} webhook: {error}"))
        return Translated(decoded)
    fault = _fault(event)
    if isinstance(fault, str):
        decoded.reject(Rejection(origin, text[:1000], fault))
        return Translated(decoded)
    parsed = parse_line(json.dumps(fault), origin)
    if isinstance(parsed, Rejection):
        decoded.reject(Rejection(origin, text[:1000], parsed.reason))
    else:
        decoded.events.append(parsed)
    return Translated(decoded)


def _fault(event: Mapping[str, Any]) -> dict[str, Any] | str:
    """The fault event for a Sentry error event, or why there is none."""
    tags = _tags(event)
    node = next((tags[t] for t in NODE_TAGS if tags.get(t)), None) or event.get("server_name")
    if not node:
        return f"no node: tag the job's Sentry events with one of {', '.join(NODE_TAGS)}"
    text = _exception_text(event)
    match = next(((k, m) for k in KINDS if (m := k.pattern.search(text))), None)
    if match is None:
        return f"no fault kind in {text[:200]!r}: not an XID, ECC, NCCL timeout, NaN loss or CUDA error"
    kind, found = match
    attributes: dict[str, Any] = {"message": text[:500], "sentry_event": event.get("event_id")}
    if kind.kind is EventKind.XID:
        attributes["code"] = int(found.group(1))
    elif kind.kind is EventKind.ECC:
        attributes["dbe"] = 1
    elif kind.kind is EventKind.JOB_CRASH:
        attributes["exit_code"] = _int(tags.get("exit_code"), -1)
    if url := event.get("web_url") or event.get("issue_url"):
        attributes["sentry_url"] = url
    if tags.get("owner"):
        attributes["owner"] = tags["owner"]
    fault: dict[str, Any] = {
        "id": f"sentry-{event.get('event_id') or hashlib.sha256(text.encode()).hexdigest()[:32]}",
        "time": _time(event),
        "source": "sentry",
        "kind": kind.kind.value,
        "node": str(node),
        "attributes": attributes,
    }
    if job := next((tags[t] for t in JOB_TAGS if tags.get(t)), None):
        fault["job"] = job
    for name in ("rank", "gpu", "iteration"):
        if (value := _int(tags.get(name), None)) is not None:
            fault[name] = value
    if tags.get("switch"):
        fault["switch"] = tags["switch"]
    return fault


def _tags(event: Mapping[str, Any]) -> dict[str, str]:
    # Sentry sends tags as [key, value] pairs (older payloads: an object).
    raw = event.get("tags") or []
    pairs = (
        raw.items()
        if isinstance(raw, dict)
        else (p for p in raw if isinstance(p, list | tuple) and len(p) == 2)
    )
    return {str(k): str(v) for k, v in pairs}


def _exception_text(event: Mapping[str, Any]) -> str:
    values = (event.get("exception") or {}).get("values") or []
    parts = [f"{v.get('type') or ''}: {v.get('value') or ''}" for v in values if isinstance(v, dict)]
    metadata = event.get("metadata") or {}
    parts += [str(event.get(k) or "") for k in ("title", "message")]
    parts += [str(metadata.get(k) or "") for k in ("type", "value")]
    return " | ".join(p for p in parts if p.strip(" :|"))


def _time(event: Mapping[str, Any]) -> str:
    if isinstance(event.get("datetime"), str):
        return event["datetime"]
    if isinstance(event.get("timestamp"), int | float):
        return datetime.fromtimestamp(event["timestamp"], UTC).isoformat()
    return datetime.now(UTC).isoformat()


def _int(value: str | None, default: int | None) -> int | None:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
