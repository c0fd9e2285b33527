"""Report training faults to GPU Medic from any training loop (see README.md here).

    hooks = MedicHooks(job="llm-7b", node=socket.gethostname(), rank=rank, sink="/shared/medic/events.jsonl")
    with hooks.watch():                      # collective timeout -> nccl_timeout, other error -> job_crash
        for step in ...:
            ...
            hooks.step(step, loss.item(), step_seconds)   # NaN/inf -> nan_loss, slow step -> straggler

Every event is a GPU Medic fault event (docs/events.md; the model is FaultEvent in medic/events.py),
one JSON object per line, appended to a file or POSTed to a URL. Reporting never stops training:
a failed HTTP delivery is logged only.

This file runs inside every rank of someone else's job, so it needs the standard library only:
no pydantic, no gpu-medic package, not even torch. `Event` checks what the schema checks for the
kinds it can emit, so a bad event fails here and not at the consumer; tests/test_medic_hooks.py
validates every kind it writes with the domain model.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import statistics
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import urllib.request

log = logging.getLogger("medic_hooks")

SOURCE = "job"
REPORTED_NOTE = "reported to GPU Medic as "  # marks an exception so watch() and the excepthook report it once
TIMEOUT_WORDS = ("timeout", "timed out")
MAX_TEXT = 200  # the schema's limit on id, source, node, job and switch


class Kind(StrEnum):
    """The event kinds a job reports: the same values as medic.events.EventKind's."""

    NAN_LOSS = "nan_loss"
    STRAGGLER = "straggler"
    JOB_CRASH = "job_crash"
    NCCL_TIMEOUT = "nccl_timeout"


def _text(name: str, value: object, *, required: bool) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or len(value) > MAX_TEXT or (required and not value):
        limit = f"1-{MAX_TEXT}" if required else f"at most {MAX_TEXT}"
        raise ValueError(f"{name}: must be a string of {limit} characters, not {value!r}")


def _count(name: str, value: object) -> int | None:
    """An integer >= 0 (any int-like: numpy and torch ints too), or None."""
    if value is None:
        return None
    try:
        number = operator.index(value)  # type: ignore[arg-type]  # checked here: that is the point
    except TypeError:
        raise ValueError(f"{name}: must be an integer >= 0, not {value!r}") from None
    if number < 0:
        raise ValueError(f"{name}: must be an integer >= 0, not {value!r}")
    return int(number)


def _check_attributes(kind: Kind, attributes: dict[str, Any]) -> None:
    """The per-kind rules of medic/events.py for the kinds a job emits."""
    if kind is Kind.STRAGGLER:
        ratio = attributes.get("step_time_ratio")
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, int | float)
            or not math.isfinite(ratio)
            or ratio <= 0
        ):
            raise ValueError(f"attributes.step_time_ratio: must be a finite number > 0, not {ratio!r}")
    elif kind is Kind.JOB_CRASH:
        code = attributes.get("exit_code")
        if isinstance(code, bool) or not isinstance(code, int):
            raise ValueError(f"attributes.exit_code: must be an integer, not {code!r}")


@dataclass(frozen=True, slots=True)
class Event:
    """One fault event, with the fields and JSON of medic.events.FaultEvent (checked on creation)."""

    id: str
    time: datetime
    source: str
    kind: Kind
    node: str
    gpu: int | None = None
    job: str | None = None
    rank: int | None = None
    iteration: int | None = None
    switch: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place, as the model does
        set_(self, "kind", Kind(self.kind))
        for name in ("id", "source", "node"):
            _text(name, getattr(self, name), required=True)
        for name in ("job", "switch"):
            _text(name, getattr(self, name), required=False)
        if not isinstance(self.time, datetime) or self.time.utcoffset() is None:
            raise ValueError(f"time: must be a timezone-aware datetime, not {self.time!r}")
        for name in ("gpu", "rank", "iteration"):
            set_(self, name, _count(name, getattr(self, name)))
        # None values are left out of attributes, as FaultEvent's validation leaves them out.
        attributes = {key: value for key, value in dict(self.attributes).items() if value is not None}
        _check_attributes(self.kind, attributes)
        set_(self, "attributes", attributes)
        self.to_json()  # JSON-able, and finite: a NaN or inf would not be JSON

    def to_dict(self) -> dict[str, Any]:
        """The document FaultEvent.model_dump(mode="json") gives: every field, None as null."""
        return {
            "id": self.id,
            "time": self.time.isoformat().replace("+00:00", "Z"),
            "source": self.source,
            "kind": self.kind.value,
            "node": self.node,
            "gpu": self.gpu,
            "job": self.job,
            "rank": self.rank,
            "iteration": self.iteration,
            "switch": self.switch,
            "attributes": self.attributes,
        }

    def to_json(self) -> str:
        """One compact JSON line, like FaultEvent.model_dump_json() (UTF-8 text, not \\u escapes)."""
        text = json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        # A lone surrogate (an undecodable byte in an error message) cannot be written as UTF-8.
        return text.encode("utf-8", "replace").decode("utf-8")


class Sink(Protocol):
    def emit(self, event: Event) -> None: ...


class FileSink:
    """Appends one line per event; several ranks may share the file (one O_APPEND write per line)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: Event) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (event.to_json() + "\n").encode())
        finally:
            os.close(fd)


class HttpSink:
    """POSTs each event as one JSON line (application/x-ndjson) to GPU Medic's intake URL."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s

    def request(self, event: Event) -> urllib.request.Request:
        import urllib.request  # here, not at the top: it costs a rank ~30 ms that a file sink never needs

        return urllib.request.Request(
            self.url,
            data=(event.to_json() + "\n").encode(),
            headers={"Content-Type": "application/x-ndjson"},
            method="POST",
        )

    def emit(self, event: Event) -> None:
        import urllib.error
        import urllib.request

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
        # Check the envelope now, not in the middle of reporting a crash.
        probe = Event("-", datetime.now(UTC), SOURCE, Kind.NAN_LOSS, node, gpu=gpu, job=job, rank=rank)
        if not (math.isfinite(straggler_ratio) and straggler_ratio > 0):
            raise ValueError(f"straggler_ratio: must be a finite number > 0, not {straggler_ratio!r}")
        self.job, self.node, self.rank, self.gpu = job, node, probe.rank, probe.gpu
        self.sink = make_sink(sink)
        self.straggler_ratio = straggler_ratio
        self.min_history = min_history
        self.min_step_time_s = min_step_time_s
        self.straggler_cooldown_s = straggler_cooldown_s
        self.clock = clock
        self.step_times: deque[float] = deque(maxlen=window)
        self.last_step: int | None = None
        self._last_straggler: float | None = None

    def event(self, kind: Kind | str, iteration: int | None = None, **attributes: Any) -> Event:
        """Build (and so validate) one event, deliver it and return it."""
        kind = Kind(kind)
        event = Event(
            # The job name is cut so that the id stays within the schema's 200 characters.
            id=f"{str(self.job)[:120]}-r{self.rank}-{kind.value}-{uuid.uuid4().hex[:12]}",
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

    def step(self, step: int, loss: float, step_time: float) -> list[Event]:
        """Call once per training step with this rank's loss and the step's wall time in seconds."""
        self.last_step = step
        events: list[Event] = []
        if not math.isfinite(loss):
            events.append(self.event(Kind.NAN_LOSS, iteration=step, loss=str(loss)))
        if not math.isfinite(step_time):
            return events  # no measurement: neither a straggler nor part of the baseline
        median = statistics.median(self.step_times) if len(self.step_times) >= self.min_history else 0.0
        if median >= self.min_step_time_s and median > 0:
            ratio = step_time / median
            now = self.clock()
            cooled = self._last_straggler is None or now - self._last_straggler >= self.straggler_cooldown_s
            if ratio >= self.straggler_ratio and cooled:
                self._last_straggler = now
                events.append(
                    self.event(
                        Kind.STRAGGLER,
                        iteration=step,
                        step_time_ratio=round(ratio, 4),
                        step_time_s=step_time,
                        median_step_time_s=median,
                    )
                )
        self.step_times.append(step_time)
        return events

    def crash(self, exit_code: int) -> Event:
        """Call just before the process exits with a failure code."""
        code = operator.index(exit_code)  # numpy/torch ints too; the schema wants an integer
        return self.event(Kind.JOB_CRASH, iteration=self.last_step, exit_code=int(code))

    def report_exception(self, error: BaseException) -> Event | None:
        """nccl_timeout for a collective timeout, job_crash (exit code 1) for anything else; once each."""
        if any(note.startswith(REPORTED_NOTE) for note in getattr(error, "__notes__", ())):
            return None
        what = {"error": type(error).__name__, "message": str(error)[:500]}
        if is_collective_timeout(error):
            event = self.event(Kind.NCCL_TIMEOUT, iteration=self.last_step, **what)
        else:
            # 1 is the exit code Python gives an uncaught exception.
            event = self.event(Kind.JOB_CRASH, iteration=self.last_step, exit_code=1, **what)
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
