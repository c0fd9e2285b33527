"""Turning raw lines into events: validation, duplicate ids, and the dead-letter record.

Nothing here raises on bad input. A line that is not a valid event becomes a `Rejection`
that names where it came from and why, and keeps the raw text so it can be fixed and replayed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NoReturn

from pydantic import ValidationError

from medic.events import FaultEvent, describe_validation_error

MAX_LINE_BYTES = 64 * 1024
RAW_KEPT = 1000  # characters of an over-long line kept in its rejection
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class Rejection:
    """A line that is not an event, kept with the reason (the dead letter)."""

    origin: str  # "events.jsonl:12"
    raw: str
    reason: str

    def __str__(self) -> str:
        return f"{self.origin}: {self.reason}"


def parse_line(raw: str, origin: str) -> FaultEvent | Rejection:
    """One line → an event, or a rejection saying why. Never raises (docs/events.md#limits)."""
    try:
        return _parse_line(raw, origin)
    except Exception as error:  # a bug of ours must cost this line, not the file
        return Rejection(
            origin, _storable(raw)[:RAW_KEPT], f"cannot be read: {type(error).__name__}: {error}"
        )


def _parse_line(raw: str, origin: str) -> FaultEvent | Rejection:
    if len(raw) > MAX_LINE_BYTES or len(raw.encode("utf-8", "replace")) > MAX_LINE_BYTES:
        return Rejection(origin, _storable(raw[:RAW_KEPT]), f"line longer than {MAX_LINE_BYTES} bytes")
    if _SURROGATE.search(raw):
        # Only a caller's own decoding (surrogateescape) puts one here; files are decoded with U+FFFD.
        return Rejection(origin, _storable(raw), "not valid UTF-8 (contains a lone surrogate)")
    if "\x00" in raw or "\\u0000" in raw:
        # PostgreSQL text cannot hold NUL: refuse it here rather than lose a whole batch later.
        return Rejection(origin, raw.replace("\x00", "\ufffd"), "contains a NUL character")
    try:
        payload = json.loads(raw, parse_constant=_not_a_number)
    except json.JSONDecodeError as error:
        return Rejection(origin, raw, f"not JSON: {error.msg} at column {error.colno}")
    except (ValueError, RecursionError) as error:
        # json raises these, not JSONDecodeError, for very deep nesting, an over-long integer or NaN.
        return Rejection(origin, raw, f"not JSON: {error}")
    if not isinstance(payload, dict):
        return Rejection(origin, raw, f"expected a JSON object, got {type(payload).__name__}")
    try:
        return FaultEvent.model_validate(payload)
    except ValidationError as error:
        return Rejection(origin, raw, describe_validation_error(error))


def _not_a_number(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _storable(text: str) -> str:
    """`text` with any lone surrogate replaced (U+FFFD), so the dead letter itself can be written."""
    return _SURROGATE.sub("\ufffd", text)


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
        return read_lines(bounded_lines(handle), str(path), seen)


def bounded_lines(handle: IO[str], limit: int = MAX_LINE_BYTES) -> Iterator[str]:
    """The lines of `handle`, but an over-long one is never held whole: its first `limit + 1`
    characters stand for it (enough for `parse_line` to reject it), the rest is skipped. A file
    of one 2 GB line costs memory for 64 KiB."""
    while True:
        line = handle.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(("\n", "\r")):
            rest = line
            while rest and not rest.endswith(("\n", "\r")):
                rest = handle.readline(limit + 1)
        yield line


def iter_jsonl(events: Iterable[FaultEvent]) -> Iterator[str]:
    for event in events:
        yield event.model_dump_json(exclude_none=True)
