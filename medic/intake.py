"""Turning raw lines into events: validation, duplicate ids, and the dead-letter record.

Nothing here raises on bad input. A line that is not a valid event becomes a `Rejection`
that names where it came from and why, and keeps the raw text so it can be fixed and replayed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from medic.events import FaultEvent, describe_validation_error

MAX_LINE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Rejection:
    """A line that is not an event, kept with the reason (the dead letter)."""

    origin: str  # "events.jsonl:12"
    raw: str
    reason: str

    def __str__(self) -> str:
        return f"{self.origin}: {self.reason}"


def parse_line(raw: str, origin: str) -> FaultEvent | Rejection:
    if len(raw.encode("utf-8", "replace")) > MAX_LINE_BYTES:
        return Rejection(origin, raw[:1000], f"line longer than {MAX_LINE_BYTES} bytes")
    if "\x00" in raw or "\\u0000" in raw:
        # PostgreSQL text cannot hold NUL: refuse it here rather than lose a whole batch later.
        return Rejection(origin, raw.replace("\x00", "\ufffd"), "contains a NUL character")
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as error:
        return Rejection(origin, raw, f"not JSON: {error.msg} at column {error.colno}")
    except (ValueError, RecursionError) as error:
        # json raises these, not JSONDecodeError, for very deep nesting or an over-long integer.
        return Rejection(origin, raw, f"not JSON: {error}")
    if not isinstance(payload, dict):
        return Rejection(origin, raw, f"expected a JSON object, got {type(payload).__name__}")
    try:
        return FaultEvent.model_validate(payload)
    except ValidationError as error:
        return Rejection(origin, raw, describe_validation_error(error))


@dataclass(slots=True)
class Intake:
    """Accepted events in arrival order, rejections, and ids dropped as repeats."""

    events: list[FaultEvent] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)


def read_lines(lines: Iterable[str], name: str, seen: set[str] | None = None) -> Intake:
    """Validate each non-blank line; `seen` holds ids already accepted earlier (e.g. in the store)."""
    seen = set() if seen is None else seen
    intake = Intake()
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        parsed = parse_line(text, f"{name}:{number}")
        if isinstance(parsed, Rejection):
            intake.rejected.append(parsed)
        elif parsed.id in seen:
            intake.duplicates.append(parsed.id)
        else:
            seen.add(parsed.id)
            intake.events.append(parsed)
    return intake


def read_file(path: Path, seen: set[str] | None = None) -> Intake:
    # utf-8-sig: a byte-order mark from a Windows editor must not cost the first event.
    with path.open(encoding="utf-8-sig", errors="replace") as handle:
        return read_lines(handle, str(path), seen)


def iter_jsonl(events: Iterable[FaultEvent]) -> Iterator[str]:
    for event in events:
        yield event.model_dump_json(exclude_none=True)
