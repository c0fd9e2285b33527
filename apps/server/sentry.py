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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from apps.server.decode import Decoded
from medic.events import EventKind
from medic.intake import MAX_LINE_BYTES, Rejection, parse_line

SECRET_ENV = "MEDIC_SENTRY_CLIENT_SECRET"
SIGNATURE_HEADER = "Sentry-Hook-Signature"
RESOURCE_HEADER = "Sentry-Hook-Resource"
# The resources that carry one error event with its tags, and where it is in `data`; the rest
# (issue, comment, installation, metric_alert, ...) are acknowledged and ignored.
EVENT_RESOURCES = {"event_alert": "event", "error": "error"}
NODE_TAGS = ("node", "host", "hostname", "server_name")
JOB_TAGS = ("job", "job_id", "slurm_job_id")
COUNT_TAGS = ("rank", "gpu", "iteration")

Tags = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Kind:
    pattern: re.Pattern[str]
    kind: EventKind
    meaning: str
    attributes: Callable[[re.Match[str], Tags], dict[str, Any]]


def _kind(
    pattern: str,
    kind: EventKind,
    meaning: str,
    attributes: Callable[[re.Match[str], Tags], dict[str, Any]] = lambda _found, _tags: {},
) -> Kind:
    return Kind(re.compile(pattern, re.IGNORECASE), kind, meaning, attributes)


# Matched against the exception's type and value, the title and the message. Most specific
# first: a CUDA error that names its XID is that XID, not a generic crash.
KINDS = (
    _kind(
        r"\bxid\b(?:\s*\([^)]*\))?(?:\s*error)?\s*[:#=]?\s*(\d{1,4})\b",
        EventKind.XID,
        "an NVIDIA XID with its number",
        lambda found, _tags: {"code": int(found[1])},
    ),
    _kind(
        r"uncorrectable ecc|double[- ]bit ecc|ecc error",
        EventKind.ECC,
        "an uncorrectable ECC error",
        lambda _found, _tags: {"dbe": 1},
    ),
    _kind(
        r"collective operation timeout|nccl.*(?:time ?out|timed out|timing out|watchdog)|DistBackendError",
        EventKind.NCCL_TIMEOUT,
        "the NCCL watchdog or a collective timing out",
    ),
    _kind(
        r"\bloss\b\W{0,3}(?:is |was |became )?(?:nan|[+-]?inf(?:inite|inity)?|non-finite)\b"
        r"|\bnan loss|non-finite loss|FloatingPointError",
        EventKind.NAN_LOSS,
        "a NaN or infinite loss",
    ),
    _kind(
        r"cuda error|illegal memory access|CUBLAS_STATUS|CUDNN_STATUS|cudaError",
        EventKind.JOB_CRASH,
        "another CUDA error",
        lambda _found, tags: {"exit_code": _integer(tags.get("exit_code"), -1)},
    ),
)


def secret_from_env(env: Mapping[str, str]) -> bytes | None:
    """MEDIC_SENTRY_CLIENT_SECRET; None, and no `POST /v1/sentry`, when unset."""
    # Stripped: a secret mounted from a file often ends in a newline, and would fail every delivery.
    return env.get(SECRET_ENV, "").strip().encode() or None


def signature_ok(secret: bytes, body: bytes, signature: str | None) -> bool:
    """Sentry signs the exact body with the integration's client secret: HMAC-SHA256, hex."""
    if not signature:
        return False
    expected = hmac.new(secret, body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(signature.strip().lower().encode(), expected.encode())


@dataclass(frozen=True, slots=True)
class Translated:
    decoded: Decoded
    ignored: str | None = None  # why nothing was taken from an authentic webhook


def translate(body: bytes, resource: str | None, remote: str) -> Translated:
    """One Sentry webhook body to at most one fault event (or its rejection)."""
    field = EVENT_RESOURCES.get(resource or "")
    if field is None:
        return Translated(Decoded(), f"resource {resource or '(none)'} carries no error event; nothing to do")
    origin, text = f"sentry:{remote}:{resource}", body.decode("utf-8", errors="replace")
    try:
        event = json.loads(text)["data"][field]
        if not isinstance(event, dict):
            raise TypeError(f"data.{field} is not an object")
        fault = _fault(event)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError, OSError) as error:
        # A signed body that is not shaped like Sentry's documented payload: say what broke.
        fault = f"not a Sentry {resource} webhook: {type(error).__name__}: {error}"
    parsed = (
        parse_line(json.dumps(fault), origin) if isinstance(fault, dict) else Rejection(origin, "", fault)
    )
    decoded = Decoded()
    if isinstance(parsed, Rejection):
        # The dead letter keeps the webhook as sent, bounded as decode.py bounds a body.
        kept = text if len(text) <= MAX_LINE_BYTES else text[:1000]
        decoded.reject(Rejection(origin, kept, parsed.reason))
    else:
        decoded.events.append(parsed)
    return Translated(decoded)


def _fault(event: Mapping[str, Any]) -> dict[str, Any] | str:
    """The fault event for a Sentry error event, or why there is none."""
    event_id = event.get("event_id")
    if not event_id:
        return "no event_id: the fault event's id is made from it"
    tags = _tags(event)
    node = next((tags[t] for t in NODE_TAGS if tags.get(t)), None) or event.get("server_name")
    if not node:
        return f"no node: tag the job's Sentry events with one of {', '.join(NODE_TAGS)}"
    text = _exception_text(event)
    match = next(((k, found) for k in KINDS if (found := k.pattern.search(text))), None)
    if match is None:
        kinds = "; ".join(k.meaning for k in KINDS)
        return f"no fault kind in {text[:200]!r}: it shows none of {kinds}"
    kind, found = match
    attributes: dict[str, Any] = {
        "message": text[:500],
        "sentry_event": event_id,
        "sentry_issue": event.get("issue_id"),
        "sentry_title": event.get("title"),
        "sentry_url": event.get("web_url") or event.get("issue_url"),
        "owner": tags.get("owner"),
    }
    fault: dict[str, Any] = {
        "id": f"sentry-{event_id}",  # a redelivery, or the same event as an alert and an error, is one fault
        "time": _time(event),
        "source": "sentry",
        "kind": kind.kind.value,
        "node": str(node),
        "job": next((tags[t] for t in JOB_TAGS if tags.get(t)), None),
        "switch": tags.get("switch") or None,
        "attributes": {k: v for k, v in attributes.items() if v} | kind.attributes(found, tags),
    }
    for name in COUNT_TAGS:
        # An unset tag reads "None" and a single process may say rank -1: leave the field out.
        if (value := _integer(tags.get(name), -1)) >= 0:
            fault[name] = value
    return {k: v for k, v in fault.items() if v is not None}


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
    return datetime.now(UTC).isoformat()  # when it reached us: the closest we know


def _integer(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
