"""Report training faults to GPU Medic from any training loop (see README.md here).

    hooks = MedicHooks(job="llm-7b", node=socket.gethostname(), rank=rank, sink="/shared/medic/events.jsonl")
    with hooks.watch():                      # collective timeout -> nccl_timeout, other error -> job_crash
        for step in ...:
            ...
            hooks.step(step, loss.item(), step_seconds)   # NaN/inf -> nan_loss, slow step -> straggler

Every event is a GPU Medic FaultEvent (medic/events.py), one JSON object per line, appended to a
file or POSTed to a URL. Reporting never stops training: a failed HTTP delivery is logged only.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from medic.events import EventKind, FaultEvent

log = logging.getLogger("medic_hooks")

SOURCE = "job"
REPORTED_NOTE = "reported to GPU Medic as "  # marks an exception so watch() and the excepthook report it once
TIMEOUT_WORDS = ("timeout", "timed out")


class Sink(Protocol):
    def emit(self, event: FaultEvent) -> None: ...


class FileSink:
    """Appends one line per event; several ranks may share the file (one O_APPEND write per line)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: FaultEvent) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (event.model_dump_json() + "\n").encode())
        finally:
            os.close(fd)


class HttpSink:
    """POSTs each event as one JSON line (application/x-ndjson) to GPU Medic's intake URL."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s

    def request(self, event: FaultEvent) -> urllib.request.Request:
        return urllib.request.Request(
            self.url,
            data=(event.model_dump_json() + "\n").encode(),
            headers={"Content-Type": "application/x-ndjson"},
            method="POST",
        )

    def emit(self, event: FaultEvent) -> None:
        try:
            with urllib.request.urlopen(self.request(event), timeout=self.timeout_s) as response:
                response.read()
        except (urllib.error.URLError, OSError) as error:
            log.warning("could not deliver %s event %s to %s: %s", event.kind, event.id, self.url, error)


def make_sink(sink: Sink | Path | str) -> Sink:
    if isinstance(sink, str) and sink.startswith(("http://", "https://")):
        return HttpSink(sink)
    if isinstance(sink, Path | str):
        return FileSink(sink)
    return sink


def is_collective_timeout(error: BaseException) -> bool:
    """A gloo/NCCL collective that timed out or lost its peers (torch's DistBackendError)."""
    if any(cls.__name__ == "DistBackendError" for cls in type(error).__mro__):
        return True
    return isinstance(error, RuntimeError) and any(word in str(error).lower() for word in TIMEOUT_WORDS)


class MedicHooks:
    def __init__(
        self,
        job: str,
        node: str,
        rank: int,
        sink: Sink | Path | str,
        *,
        gpu: int | None = None,
        straggler_ratio: float = 1.2,  # the default policy's sustained-straggler rule starts at 1.2
        window: int = 50,
        min_history: int = 5,  # the first steps (warm-up, compilation) are no baseline
        min_step_time_s: float = 0.05,  # below this, timer and scheduler noise swamp any ratio
        straggler_cooldown_s: float = 60.0,  # one report a minute is enough to count "sustained"
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job, self.node, self.rank, self.gpu = job, node, rank, gpu
        self.sink = make_sink(sink)
        self.straggler_ratio = straggler_ratio
        self.min_history = min_history
        self.min_step_time_s = min_step_time_s
        self.straggler_cooldown_s = straggler_cooldown_s
        self.clock = clock
        self.step_times: deque[float] = deque(maxlen=window)
        self.last_step: int | None = None
        self._last_straggler: float | None = None

    def event(self, kind: EventKind, iteration: int | None = None, **attributes: Any) -> FaultEvent:
        """Build (and so validate) one event, deliver it and return it."""
        event = FaultEvent(
            id=f"{self.job}-r{self.rank}-{kind.value}-{uuid.uuid4().hex[:12]}",
            time=datetime.now(UTC),
            source=SOURCE,
            kind=kind,
            node=self.node,
            gpu=self.gpu,
            job=self.job,
            rank=self.rank,
            iteration=iteration,
            attributes=attributes,
        )
        self.sink.emit(event)
        return event

    def step(self, step: int, loss: float, step_time: float) -> list[FaultEvent]:
        """Call once per training step with this rank's loss and the step's wall time in seconds."""
        self.last_step = step
        events = []
        if not math.isfinite(loss):
            events.append(self.event(EventKind.NAN_LOSS, iteration=step, loss=str(loss)))
        median = statistics.median(self.step_times) if len(self.step_times) >= self.min_history else 0.0
        if median >= self.min_step_time_s and median > 0:
            ratio = step_time / median
            now = self.clock()
            cooled = self._last_straggler is None or now - self._last_straggler >= self.straggler_cooldown_s
            if ratio >= self.straggler_ratio and cooled:
                self._last_straggler = now
                events.append(
                    self.event(
                        EventKind.STRAGGLER,
                        iteration=step,
                        step_time_ratio=round(ratio, 4),
                        step_time_s=step_time,
                        median_step_time_s=median,
                    )
                )
        self.step_times.append(step_time)
        return events

    def crash(self, exit_code: int) -> FaultEvent:
        """Call just before the process exits with a failure code."""
        return self.event(EventKind.JOB_CRASH, iteration=self.last_step, exit_code=exit_code)

    def report_exception(self, error: BaseException) -> FaultEvent | None:
        """nccl_timeout for a collective timeout, job_crash (exit code 1) for anything else; once each."""
        if any(note.startswith(REPORTED_NOTE) for note in getattr(error, "__notes__", ())):
            return None
        what = {"error": type(error).__name__, "message": str(error)[:500]}
        if is_collective_timeout(error):
            event = self.event(EventKind.NCCL_TIMEOUT, iteration=self.last_step, **what)
        else:
            # 1 is the exit code Python gives an uncaught exception.
            event = self.event(EventKind.JOB_CRASH, iteration=self.last_step, exit_code=1, **what)
        error.add_note(f"{REPORTED_NOTE}{event.kind.value} event {event.id}")
        return event

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Report an exception leaving the block, then let it propagate."""
        try:
            yield
        except Exception as error:
            self.report_exception(error)
            raise

    def install_excepthook(self) -> None:
        """Report uncaught exceptions too (for code outside `watch()`), then run the previous hook."""
        previous = sys.excepthook

        def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
            if isinstance(error, Exception):
                self.report_exception(error)
            previous(kind, error, tb)

        sys.excepthook = hook
