"""`medic triage`'s reading in a second process when the machine has the cores for it.

Reading a line into an event (JSON, the envelope's and the attributes' validation, the duplicate
check, the differential) costs about as much as correlating and deciding it. A forked process reads
the file as `medic.triage.EventReader` does and hands the events over, a handful at a time, while
this one correlates and decides the previous handful: the same events and rejections, in the same
order, so the output is the same (BENCHMARKS.md, section 2a)."""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from medic.apps.cli.forks import can_fork, cores, detach, hand_over
from medic.errors import MedicError
from medic.events import FaultEvent, validated_event
from medic.intake import Rejection
from medic.triage import EventReader, read_file

# Below this many bytes (about 4,500 events) a second process saves less than it costs to start.
PARALLEL_FROM = 1 << 20
# Events and rejections handed over at a time (about 100 kilobytes pickled), and how many handfuls
# the reading process may have read ahead of this one: what the two hold between them is bounded.
HANDFUL = 1_000
AHEAD = 4


class ReadingFailed(MedicError):
    """Raised when the process reading the file ended before handing all of it over."""


@dataclass(frozen=True, slots=True)
class _Done:
    """The reading process's last message: what `EventReader` counts once the file is read."""

    duplicates: list[str]
    chars: int


def reader_for(path: Path) -> EventReader | ForkedReader:
    """`path` opened to be read one event at a time, by a second process for a big enough file;
    raises `OSError` when it cannot be opened."""
    if path.stat().st_size >= PARALLEL_FROM and cores() >= 2 and can_fork():
        path.open(encoding="utf-8-sig").close()  # cannot be opened: said here, as `read_file` says it
        return ForkedReader(path)
    return read_file(path)


@dataclass(slots=True)
class ForkedReader:
    """`EventReader`'s events and rejections, read by a forked process."""

    path: Path
    rejected: int = 0
    duplicates: list[str] = field(default_factory=list)
    chars: int = 0

    def __enter__(self) -> ForkedReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def events(self, on_rejected: Callable[[Rejection], None]) -> Generator[FaultEvent]:
        """The events, in file order; a line that is not an event goes to `on_rejected` as it comes.
        Raises `ReadingFailed` when the reading process dies."""
        forks = multiprocessing.get_context("fork")
        receive, send = forks.Pipe(duplex=False)
        child = forks.Process(target=_read, args=(self.path, receive, send), daemon=True)
        child.start()
        send.close()
        try:
            while True:
                try:
                    message = pickle.loads(receive.recv_bytes())
                except EOFError:  # its traceback is on stderr
                    raise ReadingFailed(
                        f"the process reading {self.path} ended (exit code {_exit_code(child)}) "
                        "before the end of the file"
                    ) from None
                if isinstance(message, _Done):
                    self.duplicates, self.chars = message.duplicates, message.chars
                    return
                self.chars, handful = message
                for item in handful:
                    if isinstance(item, Rejection):
                        self.rejected += 1
                        on_rejected(item)
                    else:
                        yield validated_event(*item)
        finally:
            # Done, or given up on (an event out of order, an error, Ctrl-C): it has nothing more to do.
            # Stopped before the pipe closes, so that it never finds the pipe broken and says so.
            child.terminate()
            child.join()
            receive.close()


def _read(path: Path, receive: Connection, send: Connection) -> None:
    """The forked process: the file read as `EventReader` reads it, handed over a handful at a time."""
    detach(receive)
    # Sent by a thread, so that reading goes on while this process's handfuls wait for the other to
    # take them: the work of a handful varies on both sides (a burst of bad lines here, a storm of
    # decisions there), and a process that waits for each hand-over waits on the slower of the two.
    outbox: queue.Queue[bytes | None] = queue.Queue(maxsize=AHEAD)
    sender = threading.Thread(target=hand_over, args=(outbox.get, send.send_bytes, send), daemon=True)
    sender.start()
    handful: list[Any] = []
    given: dict[frozenset[str], frozenset[str]] = {}  # one object each: pickled once per handful
    with read_file(path) as reader:
        for event in reader.events(handful.append):
            fields = frozenset(event.__pydantic_fields_set__)
            handful.append((event.__dict__, given.setdefault(fields, fields)))
            if len(handful) >= HANDFUL:
                outbox.put(_pickled((reader.chars, handful)))
                handful.clear()  # pickled: the same list takes the rejections to come
        if handful:
            outbox.put(_pickled((reader.chars, handful)))
        outbox.put(_pickled(_Done(reader.duplicates, reader.chars)))
    outbox.put(None)
    sender.join()


def _pickled(message: object) -> bytes:
    return pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


def _exit_code(child: multiprocessing.process.BaseProcess) -> int | None:
    child.join(timeout=1)
    return child.exitcode
