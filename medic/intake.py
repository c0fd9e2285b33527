"""Turning raw lines into events: validation, duplicate ids, and the dead-letter record.

Nothing here raises on bad input. A line that is not a valid event becomes a `Rejection`
that names where it came from and why, and keeps the raw text so it can be fixed and replayed.
Accepted events then pass the differential (medic/culprit.py): step timings and a hang's
timeouts come out as the culprits they name.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NoReturn

from pydantic import ValidationError

from medic.culprit import differential
from medic.events import FaultEvent, describe_validation_error

MAX_LINE_BYTES = 64 * 1024
RAW_KEPT = 1000  # characters of an over-long line kept in its rejection
# A flood of bad lines must cost the dead letter a sample, not a row per line
# (docs/events.md#rejected-lines-dead-letters): kept verbatim per request or file; the rest counted.
DEAD_LETTER_SAMPLE = 100
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
        payload = _DECODER.decode(raw)
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


_POSITION = re.compile(r"\d+|\[\d+\]")  # a line number, or an index into a JSON array


def rejection_source(origin: str) -> str:
    """Where a rejection came from, without its line or index: `http:10.0.0.7:12` → `http:10.0.0.7`."""
    head, _, position = origin.rpartition(":")
    return head if head and _POSITION.fullmatch(position) else origin


# Reasons by their first words; every other reason is classed by the envelope field it names.
_REASON_PREFIXES = (
    ("line longer than", "too long"),
    ("not JSON", "not JSON"),
    ("expected a ", "not an object"),
    ("contains a NUL", "NUL"),
    ("not valid UTF-8", "not UTF-8"),
    ("cannot be read", "unreadable"),
)
_FIELD = re.compile(r"[a-z_]+")
_FIELDS = frozenset(FaultEvent.model_fields)


def reason_class(reason: str) -> str:
    """A reason in a few words, for counting rejections: bounded, whatever keys a flood invents.

    `too long`, `not JSON`, `not an object`, `NUL`, `not UTF-8`, `unreadable`, `unknown field`, the
    envelope field that failed first (`time`, `attributes`, ...), else `other`.
    """
    for prefix, name in _REASON_PREFIXES:
        if reason.startswith(prefix):
            return name
    first = reason.split("; ", 1)[0]
    if first.endswith("Extra inputs are not permitted"):
        return "unknown field"
    found = _FIELD.match(first)
    return found[0] if found and found[0] in _FIELDS else "other"


@dataclass(slots=True)
class RejectionSample:
    """Rejections as the dead letter takes them: the first `limit` verbatim, every one counted by
    source and reason class. A flood costs `limit` rows and a few counters; `total` says how big it was."""

    limit: int = DEAD_LETTER_SAMPLE
    kept: list[Rejection] = field(default_factory=list)
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)  # (source, reason class)
    total: int = 0

    def __len__(self) -> int:
        return self.total

    def add(self, rejection: Rejection) -> bool:
        """Count `rejection`, and keep it while the sample has room: True when kept."""
        self.total += 1
        self.counts[rejection_source(rejection.origin), reason_class(rejection.reason)] += 1
        if len(self.kept) >= self.limit:
            return False
        self.kept.append(rejection)
        return True

    @classmethod
    def of(cls, rejections: Iterable[Rejection], limit: int = DEAD_LETTER_SAMPLE) -> RejectionSample:
        sample = cls(limit)
        for rejection in rejections:
            sample.add(rejection)
        return sample


def _not_a_number(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


# One decoder for every line: `json.loads` with an option builds a new one per call, which a
# flood refused line by line pays hundreds of thousands of times.
_DECODER = json.JSONDecoder(parse_constant=_not_a_number)


def _storable(text: str) -> str:
    """`text` with any lone surrogate replaced (U+FFFD), so the dead letter itself can be written."""
    return _SURROGATE.sub("\ufffd", text)


@dataclass(slots=True)
class Intake:
    """Accepted events in arrival order (a culprit where its evidence completed, held timeouts
    once they settled), rejections, and ids dropped as repeats."""

    events: list[FaultEvent] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)


def read_lines(
    lines: Iterable[str],
    name: str,
    seen: set[str] | None = None,
    diagnose: Callable[[list[FaultEvent]], list[FaultEvent]] = differential,
) -> Intake:
    """Validate each non-blank line; `seen` holds ids already accepted earlier (e.g. in the store).
    `diagnose` takes the accepted events to the ones to correlate (`medic demo` answers the profile
    requests of its differential as it goes)."""
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
    # Step timings become the stragglers they reveal and hangs their culprits (medic/culprit.py).
    intake.events = diagnose(intake.events)
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
