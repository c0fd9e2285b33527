"""A request body to events and rejections: one JSON event, a JSON array, JSON lines, CloudEvents
(structured, batched, or binary mode with its `ce-*` headers).

Every item goes through `medic.intake.parse_line`, so an event posted over HTTP is held to
exactly the rules of a line in an events file (size, NUL characters, the schema).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from medic.apps.server.cloudevents import HEADER_PREFIX, binary_event, is_cloudevent, to_envelope
from medic.events import FaultEvent
from medic.intake import MAX_LINE_BYTES, Rejection, RejectionSample, parse_line

LINES_TYPES = frozenset(
    {"application/x-ndjson", "application/ndjson", "application/jsonl", "application/x-jsonlines"}
)
CLOUDEVENTS_TYPES = frozenset({"application/cloudevents+json", "application/cloudevents-batch+json"})
DOCUMENT_TYPES = frozenset({"application/json"}) | CLOUDEVENTS_TYPES


class Problem(BaseModel):
    """Why one item was rejected. `index`: position in a JSON array (0-based, 0 for a single
    object); `line`: line of the body (JSON lines, or where a JSON document stops parsing)."""

    index: int | None = None
    line: int | None = None
    error: str


@dataclass(slots=True)
class Decoded:
    """The events of a body, and its rejections as the dead letter takes them: a flood is a sample
    (the first `DEAD_LETTER_SAMPLE`, each with its `Problem`) and a count, never a list as long as it."""

    events: list[FaultEvent] = field(default_factory=list)
    rejections: RejectionSample = field(default_factory=RejectionSample)
    problems: list[Problem] = field(default_factory=list)

    def reject(self, rejection: Rejection, *, index: int | None = None, line: int | None = None) -> None:
        if self.rejections.add(rejection):
            self.problems.append(Problem(index=index, line=line, error=rejection.reason))


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def decode(
    body: bytes, content_type: str | None, remote: str, ce_headers: dict[str, str] | None = None
) -> Decoded:
    """Validate every item of a body; rejections carry `http:<remote>:<line>` or `...:[<index>]`.

    `ce_headers` (attribute name to raw header value, from `cloudevents.binary_headers`): a
    request with any makes one binary-mode CloudEvent, unless its Content-Type says structured.
    """
    # utf-8-sig and "replace", as for files: a BOM or one bad byte must not cost the whole body.
    text = body.decode("utf-8-sig", errors="replace")
    media = media_type(content_type)
    decoded = Decoded()
    if ce_headers and media not in CLOUDEVENTS_TYPES:
        _decode_binary(text, content_type, ce_headers, remote, decoded)
        return decoded
    if media in LINES_TYPES:
        _decode_lines(text, remote, decoded)
        return decoded
    try:
        document = json.loads(text) if text.strip() else []
    except (ValueError, RecursionError) as error:
        if media in DOCUMENT_TYPES:
            _reject_document(text, remote, error, decoded)
        else:  # no declared type and not one JSON document: JSON lines
            _decode_lines(text, remote, decoded)
        return decoded
    items = document if isinstance(document, list) else [document]
    for index, item in enumerate(items):
        raw = json.dumps(item, ensure_ascii=False)
        parsed = _validate(raw, item, f"http:{remote}:[{index}]", cloudevent=media in CLOUDEVENTS_TYPES)
        if isinstance(parsed, Rejection):
            decoded.reject(parsed, index=index)
        else:
            decoded.events.append(parsed)
    return decoded


def _decode_binary(
    text: str, content_type: str | None, ce_headers: dict[str, str], remote: str, decoded: Decoded
) -> None:
    origin = f"http:{remote}:[0]"
    try:
        parsed = _validate("", binary_event(ce_headers, text, content_type), origin, cloudevent=True)
    except ValueError as error:
        parsed = Rejection(origin, "", str(error))
    if isinstance(parsed, Rejection):
        # The dead letter keeps the request as sent: its ce-* headers, Content-Type, the body.
        head = [f"{HEADER_PREFIX}{name}: {value}" for name, value in sorted(ce_headers.items())]
        sent = "\n".join([*head, f"content-type: {content_type or ''}", "", text])
        decoded.reject(
            Rejection(origin, sent if len(sent) <= MAX_LINE_BYTES else sent[:1000], parsed.reason), index=0
        )
    else:
        decoded.events.append(parsed)


def _decode_lines(text: str, remote: str, decoded: Decoded) -> None:
    for number, raw in _lines(text):
        payload = None  # parse_line reads it, and says why when it cannot
        # Read here too only when the line may be a CloudEvent: a line that holds no "specversion"
        # and no \u escape (the one way to spell the key otherwise) cannot be one. Junk is read once.
        if "specversion" in raw or "\\u" in raw:
            with contextlib.suppress(ValueError, RecursionError):
                payload = json.loads(raw)
        parsed = _validate(raw, payload, f"http:{remote}:{number}", cloudevent=False)
        if isinstance(parsed, Rejection):
            decoded.reject(parsed, line=number)
        else:
            decoded.events.append(parsed)


def _lines(text: str) -> Iterator[tuple[int, str]]:
    # Split on \n only, as a file is read: U+2028 and friends are legal inside a JSON string. One
    # line at a time: a body of a million short lines is never a list of a million strings.
    start, number = 0, 0
    while start <= len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        number += 1
        if stripped := text[start:end].strip():
            yield number, stripped
        start = end + 1


def _validate(raw: str, payload: Any, origin: str, *, cloudevent: bool) -> FaultEvent | Rejection:
    if not (cloudevent or is_cloudevent(payload)):
        return parse_line(raw, origin)
    try:
        envelope = to_envelope(payload)
    except ValueError as error:
        return Rejection(origin, raw, str(error))
    parsed = parse_line(json.dumps(envelope, ensure_ascii=False), origin)
    # The dead letter keeps what was sent, so it can be fixed and posted again as it was.
    return Rejection(origin, raw, parsed.reason) if isinstance(parsed, Rejection) else parsed


def _reject_document(text: str, remote: str, error: Exception, decoded: Decoded) -> None:
    line = error.lineno if isinstance(error, json.JSONDecodeError) else None
    if isinstance(error, json.JSONDecodeError):
        reason = f"not JSON: {error.msg} at line {error.lineno} column {error.colno}"
    else:
        reason = f"not JSON: {error}"
    raw = text if len(text) <= MAX_LINE_BYTES else text[:1000]
    decoded.reject(Rejection(f"http:{remote}:{line or 1}", raw, reason), line=line)
