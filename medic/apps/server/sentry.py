"""Sentry webhooks to fault events (`POST /v1/sentry`, docs/serve.md#sentry).

Training jobs report their exceptions to Sentry, tagged with where they ran (node, job, rank,
GPU, iteration). A Sentry internal integration forwards each error or issue alert here; the
exception's text says what kind of fault it is, by the first matching row of `KINDS`. An
exception that matches no row (an OOM, a `KeyError` in the data loader) is no GPU fault: it is
acknowledged, counted and dropped (`MEDIC_SENTRY_UNMATCHED=reject`: dead-lettered instead). An
event that names no node, or that is not shaped like Sentry's payload, goes to the dead letter
with the reason: it is kept, never guessed at.

`Sentry-Hook-Timestamp` (Unix seconds when Sentry sent the request; not covered by the
signature) must be within the replay window of our clock, `MEDIC_SENTRY_REPLAY_WINDOW_SECONDS`.
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

from medic.apps.server.decode import Decoded
from medic.events import EventKind
from medic.intake import MAX_LINE_BYTES, Rejection, parse_line

SECRET_ENV = "MEDIC_SENTRY_CLIENT_SECRET"
WINDOW_ENV = "MEDIC_SENTRY_REPLAY_WINDOW_SECONDS"
UNMATCHED_ENV = "MEDIC_SENTRY_UNMATCHED"
DEFAULT_WINDOW_S = 300
SIGNATURE_HEADER = "Sentry-Hook-Signature"
RESOURCE_HEADER = "Sentry-Hook-Resource"
TIMESTAMP_HEADER = "Sentry-Hook-Timestamp"
# The resources that carry one error event with its tags, and where it is in `data`; the rest
# (issue, comment, installation, metric_alert, ...) are acknowledged and ignored.
EVENT_RESOURCES = {"event_alert": "event", "error": "error"}
NODE_TAGS = ("node", "host", "hostname", "server_name")
JOB_TAGS = ("job", "job_id", "slurm_job_id")
COUNT_TAGS = ("rank", "gpu", "iteration")
# The patterns see at most this much of the exception's text: with only bounded quantifiers and
# no nested ones, matching is linear in it, whatever a webhook holds.
MAX_MATCHED_CHARS = 64 * 1024
# Why a webhook was acknowledged and dropped: the `reason` label of medic_sentry_ignored_total.
NO_ERROR_EVENT = "no_error_event"
NOT_A_FAULT = "not_a_fault"

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
# first: a CUDA error that names its XID is that XID, not a generic crash. Every quantifier is
# bounded and none is nested (tests/entrypoints/test_sentry.py checks both): linear time. The NaN row holds
# the messages of the major training frameworks; tests/fixtures/sentry/SOURCES.md says where
# each comes from.
KINDS = (
    _kind(
        r"\bxid\b(?:\s{0,8}\([^)]{0,64}\))?(?:\s{0,8}error)?\s{0,8}[:#=]?\s{0,8}(\d{1,4})\b",
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
        r"collective operation timeout|DistBackendError"
        r"|nccl.{0,300}?(?:time ?out|timed out|timing out|watchdog)",
        EventKind.NCCL_TIMEOUT,
        "the NCCL watchdog or a collective timing out",
    ),
    _kind(
        # generic: "loss is nan", "loss = inf", "non-finite loss", "NaN loss" (NeMo: "Got NaN loss
        # with non-empty input"), FloatingPointError (fairseq: "Minimum loss scale reached")
        r"\bloss\b\W{0,3}(?:is |was |became )?(?:nan|[+-]?inf(?:inite|inity)?|non-finite)\b"
        r"|\bnan loss|non-finite loss|FloatingPointError"
        # Megatron-LM: "found NaN in local grad norm ...", "found Inf in local forward loss ..."
        r"|\bfound (?:nan|inf) in\b"
        # torch.autograd anomaly detection: "Function 'MulBackward0' returned nan values in its 0th output."
        r"|returned nan values in its \d{1,4}th output"
        # Lightning: "The loss returned in `training_step` is nan." (or tensor(nan, ...))
        r"|loss returned in .{1,40}? is (?:tensor\()?[+-]?(?:nan|inf)\b"
        # Lightning EarlyStopping "Monitored metric val_loss = nan is not finite.", NeMo
        # "ctc_loss is not finite", torch clip_grad_norm_ "... is non-finite, so it cannot be clipped"
        r"|\bis (?:not finite|non-finite)\b"
        # NeMo: "detected inf or nan values in gradients! Setting gradients to zero."
        r"|\b(?:nan|inf)(?: or (?:nan|inf))? values in gradients"
        # DeepSpeed: "Current loss scale already at minimum - cannot decrease scale anymore."
        r"|loss scale already at minimum",
        EventKind.NAN_LOSS,
        "a NaN or infinite loss or gradient",
    ),
    _kind(
        # "CUDA error: out of memory" is an out-of-memory, the job's problem, not the GPU's.
        r"cuda error(?!: out of memory)|illegal memory access|CUBLAS_STATUS|CUDNN_STATUS|cudaError",
        EventKind.JOB_CRASH,
        "another CUDA error",
        lambda _found, tags: {"exit_code": _integer(tags.get("exit_code"), -1)},
    ),
)


@dataclass(frozen=True, slots=True)
class Options:
    """How `POST /v1/sentry` treats what is not a fault, and stale deliveries."""

    window_s: int = DEFAULT_WINDOW_S  # Sentry-Hook-Timestamp must be this close to now; 0: unchecked
    reject_unmatched: bool = False  # True: an exception of no fault kind is a 422 and a dead letter

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Options:
        """MEDIC_SENTRY_REPLAY_WINDOW_SECONDS (default 300) and MEDIC_SENTRY_UNMATCHED (ignore, reject)."""
        window = env.get(WINDOW_ENV, "").strip() or str(DEFAULT_WINDOW_S)
        if not (window.isascii() and window.isdigit()):
            raise ValueError(f"{WINDOW_ENV} must be a whole number of seconds (0: no check), got {window!r}")
        unmatched = env.get(UNMATCHED_ENV, "").strip().lower() or "ignore"
        if unmatched not in ("ignore", "reject"):
            raise ValueError(f"{UNMATCHED_ENV} must be ignore or reject, got {unmatched!r}")
        return cls(window_s=int(window), reject_unmatched=unmatched == "reject")


def timestamp_problem(value: str | None, now: float, window_s: int) -> str | None:
    """Why a delivery's Sentry-Hook-Timestamp is refused (missing, stale, from the future), or None."""
    if window_s <= 0:
        return None
    stamp = (value or "").strip()
    # ASCII digits only: `isdigit` holds for "²" too, which int() refuses.
    if not (stamp.isascii() and stamp.isdigit()):
        return f"{TIMESTAMP_HEADER} missing or not Unix seconds: {(value or '')[:40]!r}"
    skew = now - int(stamp)
    if skew > window_s:
        return f"{TIMESTAMP_HEADER} is {skew:.0f} s old, outside the {window_s} s replay window"
    if -skew > window_s:
        return f"{TIMESTAMP_HEADER} is {-skew:.0f} s in the future, outside the {window_s} s replay window"
    return None


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
    reason: str | None = None  # NO_ERROR_EVENT or NOT_A_FAULT when ignored


class _NotAFault(str):
    """Why an error event is no GPU fault: its exception matches no row of KINDS."""


def translate(
    body: bytes, resource: str | None, remote: str, *, reject_unmatched: bool = False
) -> Translated:
    """One Sentry webhook body to at most one fault event (or its rejection)."""
    field = EVENT_RESOURCES.get(resource or "")
    if field is None:
        why = f"resource {resource or '(none)'} carries no error event; nothing to do"
        return Translated(Decoded(), why, NO_ERROR_EVENT)
    origin, text = f"sentry:{remote}:{resource}", body.decode("utf-8", errors="replace")
    try:
        event = json.loads(text)["data"][field]
        if not isinstance(event, dict):
            raise TypeError(f"data.{field} is not an object")
        fault = _fault(event)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError, OSError) as error:
        # A signed body that is not shaped like Sentry's documented payload: say what broke.
        fault = f"not a Sentry {resource} webhook: {type(error).__name__}: {error}"
    if isinstance(fault, _NotAFault) and not reject_unmatched:
        return Translated(Decoded(), str(fault), NOT_A_FAULT)
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
    """The fault event for a Sentry error event, or why there is none (`_NotAFault`: no GPU fault)."""
    text = _exception_text(event)[:MAX_MATCHED_CHARS]
    match = next(((k, found) for k in KINDS if (found := k.pattern.search(text))), None)
    if match is None:
        kinds = "; ".join(k.meaning for k in KINDS)
        return _NotAFault(f"no fault kind in {text[:200]!r}: it shows none of {kinds}")
    event_id = event.get("event_id")
    if not event_id:
        return "no event_id: the fault event's id is made from it"
    tags = _tags(event)
    node = next((tags[t] for t in NODE_TAGS if tags.get(t)), None) or event.get("server_name")
    if not node:
        return f"no node: tag the job's Sentry events with one of {', '.join(NODE_TAGS)}"
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
