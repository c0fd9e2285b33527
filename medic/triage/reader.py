"""A file of events read one at a time, as `medic triage` streams it."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from medic.culprit import Differential
from medic.events import FaultEvent
from medic.intake import Rejection, bounded_lines, parse_line
from medic.triage.ids import EventIds


@dataclass(slots=True)
class EventReader:
    """A file's events, one line at a time, as `medic.intake.read_file` takes them: blank lines
    skipped, an id seen before dropped (and kept in `duplicates`). `chars` counts what has been
    read, for progress."""

    handle: IO[str]
    name: str
    rejected: int = 0
    duplicates: list[str] = field(default_factory=list)
    chars: int = 0

    def __enter__(self) -> EventReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.handle.close()

    def events(self, on_rejected: Callable[[Rejection], None]) -> Generator[FaultEvent]:
        """The events, in file order; a line that is not an event goes to `on_rejected` as it comes."""
        seen = EventIds()
        differential = Differential()  # as medic.intake.read_lines: culprits, not victims
        for number, raw in enumerate(bounded_lines(self.handle), start=1):
            self.chars += len(raw)
            text = raw.strip()
            if not text:
                continue
            parsed = parse_line(text, f"{self.name}:{number}")
            if isinstance(parsed, Rejection):
                self.rejected += 1
                on_rejected(parsed)
            elif not seen.add(parsed.id):
                self.duplicates.append(parsed.id)
            else:
                yield from differential.push(parsed)
        yield from differential.flush()


def read_file(path: Path) -> EventReader:
    """`path` opened to be read one event at a time; raises `OSError` when it cannot be opened.

    The streaming twin of `medic.intake.read_file`, which reads the whole file at once."""
    # utf-8-sig and replace, as medic.intake.read_file: the same text gives the same events.
    return EventReader(path.open(encoding="utf-8-sig", errors="replace"), str(path))
