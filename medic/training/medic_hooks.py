"""Report training faults to GPU Medic from any training loop (see README.md here).

    hooks = MedicHooks(job="llm-7b", node=socket.gethostname(), rank=rank, sink="/shared/medic/events.jsonl")
    with hooks.watch():                      # collective timeout -> nccl_timeout, other error -> job_crash
        for step in ...:
            ...
            hooks.step(step, loss.item(), step_seconds)   # NaN/inf -> nan_loss, slow step -> straggler

With `timings_every=N` the rank reports its step times every N steps instead of judging itself
(GPU Medic compares it with its peers: docs/culprit.md), and `hooks.collective()`, called as the
rank enters each collective, tells its own work from its wait for the others and says, on a
timeout, which collective it was in.

With `hooks.profile_on_demand(directory)` the rank says when a short profile of it is worth taking:
`hooks.profile_wanted()` hands the loop a `ProfileRequest` once its own work has slowed against its
recent past, or once a request file for it appears in `directory`; the loop (which has torch) profiles
the next steps into the request's path and calls `hooks.profiled(...)`, which reports it.

Every event is a GPU Medic fault event (docs/events.md; the model is FaultEvent in medic/events.py),
one JSON object per line, appended to a file or POSTed to a URL (`HttpSink`: from a thread of its
own, in batches, with the bearer token of MEDIC_TOKEN_FILE or MEDIC_TOKEN). Reporting never stops
training: a step only queues its event, and a failed delivery is tried again in the background.

This file runs inside every rank of someone else's job, so it needs the standard library only:
no pydantic, no gpu-medic package, not even torch. `Event` checks what the schema checks for the
kinds it can emit, so a bad event fails here and not at the consumer; tests/training/test_medic_hooks.py
validates every kind it writes with the domain model.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import math
import operator
import os
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import urllib.error
    import urllib.request

log = logging.getLogger("medic_hooks")

SOURCE = "job"
REPORTED_NOTE = "reported to GPU Medic as "  # marks an exception so watch() and the excepthook report it once
TIMEOUT_WORDS = ("timeout", "timed out")
MAX_TEXT = 200  # the schema's limit on id, source, node, job and switch
JOB_HEADER = "X-Medic-Job"  # what a load balancer in front of replicas routes on (HttpSink)
# HttpSink: where its bearer token comes from (GPU Medic's agent reads the same MEDIC_TOKEN).
TOKEN_ENV, TOKEN_FILE_ENV = "MEDIC_TOKEN", "MEDIC_TOKEN_FILE"
MAX_QUEUE = 10_000  # events queued while GPU Medic is slow or away; the oldest go first past it
MAX_BATCH = 500  # events in one POST (a few hundred kB, far under the intake's 16 MB)
FLUSH_S = 5.0  # how long the process waits for queued events at exit and after a crash
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # pauses between tries while delivery fails
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})  # passing: try again
MAX_TIMINGS_EVERY = 400  # a report's two lists stay within the schema's 1000 attribute items


class Kind(StrEnum):
    """The event kinds a job reports: the same values as medic.events.EventKind's."""

    NAN_LOSS = "nan_loss"
    STRAGGLER = "straggler"
    JOB_CRASH = "job_crash"
    NCCL_TIMEOUT = "nccl_timeout"


class Report(StrEnum):
    """The kinds a job sends that report how it runs rather than a fault (also EventKind values)."""

    HEALTH_CHECK = "health_check"  # check: step_timings, stall or profile


def _kind(value: str) -> Kind | Report:
    return Report(value) if value in Report.__members__.values() else Kind(value)


TIMINGS_CHECK = "step_timings"
STALL_CHECK = "stall"
PROFILE_CHECK = "profile"
PROFILE_REQUEST_SUFFIX = ".profile-request"  # <job>-r<rank>.profile-request in the profile directory
MAX_PROFILE_STEPS = 20  # nobody's request keeps a rank under the profiler for long
# A request's `from_step` this many steps past still starts (at once): a pair asked together stays
# mostly on the same steps. Further past, the steps it wanted are gone and it is dropped.
STALE_REQUEST_STEPS = 3
FLIGHT_RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
HEALTH_CHECK_PHASES = ("prolog", "epilog", "healthcheck")


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


def _check_attributes(kind: Kind | Report, attributes: dict[str, Any]) -> None:
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
    elif kind is Report.HEALTH_CHECK and attributes.get("phase", "healthcheck") not in HEALTH_CHECK_PHASES:
        raise ValueError(
            f"attributes.phase: must be one of {HEALTH_CHECK_PHASES}, not {attributes['phase']!r}"
        )


@dataclass(frozen=True, slots=True)
class Event:
    """One fault event, with the fields and JSON of medic.events.FaultEvent (checked on creation)."""

    id: str
    time: datetime
    source: str
    kind: Kind | Report
    node: str
    gpu: int | None = None
    job: str | None = None
    rank: int | None = None
    iteration: int | None = None
    switch: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place, as the model does
        set_(self, "kind", _kind(self.kind))
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
    """Delivers events to GPU Medic's intake URL from a thread of its own, so that a slow or unreachable
    GPU Medic never holds a step: `emit` only queues. The thread POSTs what queued in batches (one
    request a batch, JSON lines, `application/x-ndjson`), authenticated as GPU Medic's other senders
    are (`Authorization: Bearer`, the token from MEDIC_TOKEN_FILE or MEDIC_TOKEN; never in the URL).

    A delivery that fails for a passing reason (no connection, a timeout, 408, 429, 5xx) is tried again
    after a growing pause (BACKOFF_S; a longer Retry-After is honoured), its batch kept first in line.
    Meanwhile the queue holds at most `max_queue` events: past that the oldest go, counted, and said
    once delivery resumes. A refusal (401/403: the token; 422: events the schema rejects; any other
    4xx) is not tried again, and each is logged once with GPU Medic's reason, not once per event.
    `flush` waits, bounded, for what is queued: at exit, and from `MedicHooks.crash`."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
        max_queue: int = MAX_QUEUE,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self.url = url
        self.token = token if token is not None else token_from(os.environ)
        self.timeout_s = timeout_s
        self.max_queue, self.max_batch = max_queue, max_batch
        self.dropped = 0  # events the full queue let go, in all
        self.refused = 0  # events GPU Medic refused for good, in all
        self.delivered = 0  # events GPU Medic took, in all
        self._dropped_unsaid = 0
        self._told: set[str] = set()  # each refusal's reason, logged once
        self._failures = 0  # tries in a row that failed for a passing reason
        self._start()

    def _start(self) -> None:
        """A fresh queue and no thread yet: at construction, and in a forked child (the thread is
        the parent's; a data loader's worker that reports gets its own)."""
        self._pid = os.getpid()
        self._queue: deque[Event] = deque()
        self._sending = 0  # events in the request under way
        self._cond = threading.Condition()
        self._flushes = 0  # flushes begun: each cuts the pause before the next try short
        self._flushing = 0  # flushes waiting now: the pauses between tries stay short meanwhile
        self._thread: threading.Thread | None = None

    def emit(self, event: Event) -> None:
        if os.getpid() != self._pid:
            self._start()
        with self._cond:
            self._queue.append(event)
            self._bound()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="medic-hooks-sink", daemon=True)
                self._thread.start()
                atexit.register(self.flush)
            self._cond.notify_all()

    def flush(self, timeout_s: float = FLUSH_S) -> bool:
        """Wait up to `timeout_s` for every queued event to be delivered or refused; a pause before
        the next try is cut short. True when nothing is left."""
        with self._cond:
            self._flushes += 1
            self._flushing += 1
            self._cond.notify_all()
            try:
                done = self._cond.wait_for(lambda: not self._queue and not self._sending, timeout_s)
            finally:
                self._flushing -= 1
        if not done:
            log.warning("%d event(s) not delivered to %s yet", len(self._queue) + self._sending, self.url)
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                batch = self._take()
            pause = self._send(batch)
            with self._cond:
                self._sending = 0
                if pause:  # kept first in line, within the bound
                    self._queue.extendleft(reversed(batch))
                    self._bound()
                self._cond.notify_all()
                if pause:
                    # A flush that begins cuts the pause short; one under way keeps it short.
                    if self._flushing:
                        pause = min(pause, BACKOFF_S[0])
                    self._cond.wait_for(self._flush_began(), pause)

    def _flush_began(self) -> Callable[[], bool]:
        """True once a flush begins after this call (under the lock)."""
        seen = self._flushes
        return lambda: self._flushes != seen

    def _bound(self) -> None:
        """Past `max_queue`, the oldest events go, counted (said once delivery resumes)."""
        while len(self._queue) > self.max_queue:
            self._queue.popleft()
            self.dropped += 1
            self._dropped_unsaid += 1

    def _take(self) -> list[Event]:
        """The oldest events, up to `max_batch`, of one job (the request's X-Medic-Job)."""
        job = self._queue[0].job
        batch: list[Event] = []
        while self._queue and len(batch) < self.max_batch and self._queue[0].job == job:
            batch.append(self._queue.popleft())
        self._sending = len(batch)
        return batch

    def request(self, batch: list[Event]) -> urllib.request.Request:
        import urllib.request  # here, not at the top: it costs a rank ~30 ms that a file sink never needs

        headers = {"Content-Type": "application/x-ndjson"} | _routing(batch[0].job)
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return urllib.request.Request(
            self.url,
            data="".join(event.to_json() + "\n" for event in batch).encode(),
            # A load balancer in front of several replicas routes on the job: a job's peer
            # comparison needs every rank's step timings in one replica (GPU Medic's docs/serve.md).
            headers=headers,
            method="POST",
        )

    def _send(self, batch: list[Event]) -> float:
        """POST one batch: 0 when it is settled (taken or refused), else the pause before trying again."""
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.request(batch), timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as error:
            if error.code in RETRY_STATUSES:
                return self._failed(f"HTTP {error.code}", _retry_after(error.headers.get("Retry-After")))
            self.refused += len(batch)
            self._tell(f"HTTP {error.code}", _reason(error))
            return 0.0
        except (urllib.error.URLError, OSError) as error:  # no connection, a timeout, a reset
            return self._failed(str(getattr(error, "reason", error)), 0.0)
        self.delivered += len(batch)
        if self._failures or self._dropped_unsaid:
            log.warning(
                "delivering events to %s again after %d failed tries; %d event(s) dropped meanwhile "
                "(the queue holds %d)",
                self.url,
                self._failures,
                self._dropped_unsaid,
                self.max_queue,
            )
        self._failures = self._dropped_unsaid = 0
        return 0.0

    def _failed(self, why: str, retry_after_s: float) -> float:
        self._failures += 1
        pause = max(BACKOFF_S[min(self._failures, len(BACKOFF_S)) - 1], min(retry_after_s, BACKOFF_S[-1]))
        if self._failures == 1:  # once per outage; the recovery line says how long it lasted
            log.warning("could not deliver events to %s (%s); trying again in the background", self.url, why)
        return pause

    def _tell(self, status: str, reason: str) -> None:
        if status in self._told:
            return
        self._told.add(status)
        hint = ""
        if status in ("HTTP 401", "HTTP 403"):
            hint = f" (set {TOKEN_FILE_ENV} or {TOKEN_ENV} to a token GPU Medic accepts)"
        log.error("GPU Medic at %s refused events: %s %s%s; not sent again", self.url, status, reason, hint)


def token_from(env: Mapping[str, str]) -> str | None:
    """The bearer token: the file MEDIC_TOKEN_FILE names (a secret mounted as a file), else MEDIC_TOKEN."""
    path = env.get(TOKEN_FILE_ENV)
    if path:
        try:
            return Path(path).read_text(encoding="utf-8").strip() or None
        except OSError as error:
            log.error(
                "could not read %s=%s: %s; events are sent without a token", TOKEN_FILE_ENV, path, error
            )
            return None
    return env.get(TOKEN_ENV) or None


def _retry_after(value: str | None) -> float:
    try:
        return float(value) if value else 0.0
    except ValueError:  # an HTTP date: the pause of our own will do
        return 0.0


def _reason(error: urllib.error.HTTPError) -> str:
    """GPU Medic's reason for a refusal, from its JSON answer when there is one."""
    try:
        body = error.read().decode("utf-8", "replace")
    except Exception:
        return str(error)
    try:
        answer = json.loads(body)
    except ValueError:
        return body[:300]
    if isinstance(answer, dict):
        if "error" in answer:
            return str(answer["error"])[:300]
        if answer.get("rejected"):
            return json.dumps(answer["rejected"][:3])[:300]
    return body[:300]


def _routing(job: str | None) -> dict[str, str]:
    """The job as a header, when it can be one (visible ASCII and spaces): a job name that cannot
    is sent without it rather than failing the rank's request."""
    if job and job.isascii() and job.isprintable():
        return {JOB_HEADER: job}
    return {}


def make_sink(sink: Sink | Path | str) -> Sink:
    if isinstance(sink, str) and sink.startswith(("http://", "https://")):
        return HttpSink(sink)
    if isinstance(sink, Path | str):
        return FileSink(sink)
    return sink


# PyTorch's dumps of the flight recorder, by backend. On torch 2.11 an NCCL group's records are in
# the NCCL dump only (the generic one answers an empty `pg_status` there), gloo's in the generic one
# (docs/gpu-run.md): each is asked until one knows the group.
FLIGHT_RECORDER_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")


def flight_recorder_status(pg: str = "0") -> dict[str, Any] | None:
    """The process group's `pg_status` in PyTorch's flight recorder (the default group is "0"), where
    the job runs with one and has loaded torch: this library never imports it itself."""
    if not any(os.environ.get(name, "0") not in ("", "0") for name in FLIGHT_RECORDER_ENV):
        return None
    c10d = getattr(getattr(sys.modules.get("torch"), "_C", None), "_distributed_c10d", None)
    for name in FLIGHT_RECORDER_DUMPS:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            status = json.loads(dump()).get("pg_status", {}).get(pg)
        except Exception as error:  # a trace we cannot read must not cost the report it goes in
            log.warning("could not read the flight recorder (%s): %s", name, error)
            continue
        if isinstance(status, dict):
            return status
    return None


def is_collective_timeout(error: BaseException) -> bool:
    """A gloo/NCCL collective that timed out or lost its peers (torch's DistBackendError)."""
    if any(cls.__name__ == "DistBackendError" for cls in type(error).__mro__):
        return True
    return isinstance(error, RuntimeError) and any(word in str(error).lower() for word in TIMEOUT_WORDS)


@dataclass(frozen=True, slots=True)
class Slowdown:
    """When a rank's own work has slowed: the median of its last `recent` steps is at least `ratio`
    times the median of the `history` steps before them, once there are `min_history` of those and
    their median is at least `min_step_s` (below that, timer and scheduler noise swamp any ratio).
    A median of several steps: one slow step (a collection, a page fault) is no slowdown."""

    ratio: float = 1.2  # the default policy's straggler ratio
    recent: int = 5
    history: int = 50
    min_history: int = 10  # the first steps (warm-up, compilation) weigh little in ten
    min_step_s: float = 0.02  # shorter steps are mostly launch overhead and scheduler noise

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ratio) and self.ratio > 1):
            raise ValueError(f"ratio: must be a finite number > 1, not {self.ratio!r}")
        if not 1 <= self.min_history <= self.history or self.recent < 1:
            raise ValueError(f"need recent >= 1 and 1 <= min_history <= history, not {self!r}")


class SlowdownWatch:
    """One rank's step times against its own recent past: a few operations a step."""

    def __init__(self, rule: Slowdown) -> None:
        self.rule = rule
        self.recent: deque[float] = deque(maxlen=rule.recent)
        self.history: deque[float] = deque(maxlen=rule.history)
        self.slowed = False

    def push(self, seconds: float) -> dict[str, float] | None:
        """Take one step's time; the slowdown's figures while the recent steps are slower."""
        # While slowed the baseline holds still: a slowdown seen in a cooldown is still one after it.
        if len(self.recent) == self.rule.recent and not self.slowed:
            self.history.append(self.recent[0])
        self.recent.append(seconds)
        found = self._judge()
        self.slowed = found is not None
        return found

    def _judge(self) -> dict[str, float] | None:
        if len(self.history) < self.rule.min_history or len(self.recent) < self.rule.recent:
            return None
        now = statistics.median(self.recent)
        if now < self.rule.ratio * self.rule.min_step_s:
            return None  # cheap way out first: nothing slow enough to weigh the history for
        before = statistics.median(self.history)
        if before < self.rule.min_step_s or now < self.rule.ratio * before:
            return None
        return {"slowdown_ratio": round(now / before, 4), "recent_median_s": now, "baseline_median_s": before}

    def restart(self) -> None:
        """Forget the past: the pace from now on is the new baseline."""
        self.recent.clear()
        self.history.clear()
        self.slowed = False


@dataclass(frozen=True, slots=True)
class ProfileRequest:
    """Profile this rank's next `steps` steps into `path` (a Chrome trace), then call `hooks.profiled`."""

    path: Path
    steps: int
    reason: str  # "slowdown": its own work slowed; "requested": a request file asked for it
    figures: dict[str, float] = field(default_factory=dict)  # the slowdown's, reported with the profile


@dataclass(frozen=True, slots=True)
class _Asked:
    """What a request file asks for: `steps` steps from step `from_step` on (None: at once)."""

    steps: int
    from_step: int | None


class ProfileTrigger:
    """Decides when this rank's profile is worth taking; the loop takes it (see profile_on_demand)."""

    def __init__(
        self,
        folder: Path,
        name: str,
        steps: int,
        cooldown_s: float,
        slowdown: Slowdown,
        poll_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.folder, self.name, self.steps = folder, name, steps
        self.request_file = folder / f"{name}{PROFILE_REQUEST_SUFFIX}"
        self.cooldown_s, self.poll_s, self.clock = cooldown_s, poll_s, clock
        self.watch = SlowdownWatch(slowdown)
        self.taking = False  # handed out and not reported yet: its steps carry the profiler's overhead
        self.pending: dict[str, float] | None = None  # a slowdown seen, not handed out yet
        self.scheduled: _Asked | None = None  # a request file's profile, waiting for its first step
        self.last_at: float | None = None
        self.poll_at = clock()

    def observe(self, seconds: float) -> None:
        if self.taking:
            return  # profiled steps are slower by the profiler itself: no baseline, no trigger
        found = self.watch.push(seconds)
        if found is not None and self.pending is None:
            cooled = self.last_at is None or self.clock() - self.last_at >= self.cooldown_s
            if cooled:
                self.pending = found

    def wanted(self, next_step: int) -> ProfileRequest | None:
        if self.taking:
            return None
        now = self.clock()
        if now >= self.poll_at:
            # A file system call every poll_s, not every step: on a shared one a stat can take ms.
            self.poll_at = now + self.poll_s
            asked = self._take_request()
            if asked is not None:
                self.scheduled = asked  # a newer request replaces one still waiting for its step
        steps, reason, figures = self.steps, "slowdown", self.pending
        if self.scheduled is not None:
            start = self.scheduled.from_step
            if start is not None and next_step < start:
                # Waiting for the steps asked for: a slowdown's profile begun now could run into them.
                return None
            if start is not None and next_step - start > STALE_REQUEST_STEPS:
                log.warning(
                    "profile request for the steps from %d dropped as stale: this rank is at step %d",
                    start,
                    next_step,
                )
                self.scheduled = None
            else:
                steps, reason, figures = self.scheduled.steps, "requested", {}
                self.scheduled = None
        if figures is None:
            return None
        if reason == "slowdown":
            self.watch.restart()  # one profile per slowdown: the slower pace is the baseline now
            self.pending = None
        self.taking, self.last_at = True, now
        path = self.folder / f"{self.name}-step{next_step}-profile.pt.trace.json"
        return ProfileRequest(path, steps, reason, figures)

    def _take_request(self) -> _Asked | None:
        """What a request file asks for, taking it (one request, one profile); None without one."""
        try:
            text = self.request_file.read_text()
        except FileNotFoundError:
            return None
        except OSError as error:
            log.warning("could not read the profile request %s: %s", self.request_file, error)
            return None
        try:
            self.request_file.unlink()
        except FileNotFoundError:
            pass
        except OSError as error:  # left in place it would ask again at every poll
            log.error("cannot take the profile request %s (%s): requests are off", self.request_file, error)
            self.poll_at = math.inf
            return None
        try:
            body = json.loads(text) if text.strip() else {}
        except ValueError:
            body = None
        if not isinstance(body, dict):
            body = {"steps": None}  # not an object: the default steps, at once
        asked = body.get("steps", self.steps)
        if isinstance(asked, bool) or not isinstance(asked, int) or not 1 <= asked <= MAX_PROFILE_STEPS:
            log.warning(
                "profile request %r: steps must be 1-%d; taking %d", text[:200], MAX_PROFILE_STEPS, self.steps
            )
            asked = self.steps
        start = body.get("from_step")
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
            log.warning(
                "profile request %r: from_step must be an integer >= 0; profiling at once", text[:200]
            )
            start = None
        return _Asked(asked, start)


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
        world_size: int | None = None,
        timings_every: int | None = None,
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
        self.world_size = _count("world_size", world_size)
        if timings_every is not None and not 1 <= timings_every <= MAX_TIMINGS_EVERY:
            raise ValueError(f"timings_every: must be 1-{MAX_TIMINGS_EVERY}, not {timings_every!r}")
        if timings_every is not None and self.world_size is None:
            raise ValueError("timings_every: needs world_size (peers are compared in steps all of them ran)")
        self.timings_every = timings_every
        self.collectives = 0  # entered so far: where this rank is, should one of them time out
        self._entered_at: float | None = None  # perf_counter at the first collective of this step
        self._window: list[tuple[int, float, float | None]] = []  # (step, step time, compute time)
        self._progress_at = time.monotonic()  # the stall watch's one look at the loop: a float a step
        self._profiles: ProfileTrigger | None = None

    def event(self, kind: Kind | Report | str, iteration: int | None = None, **attributes: Any) -> Event:
        """Build (and so validate) one event, deliver it and return it."""
        kind = _kind(kind)
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

    def collective(self) -> None:
        """Call as this rank enters a collective (a DDP comm hook, a wrapper of all_reduce): cheap."""
        self.collectives += 1
        if self._entered_at is None:
            self._entered_at = time.perf_counter()

    def step(self, step: int, loss: float, step_time: float) -> list[Event]:
        """Call once per training step with this rank's loss and the step's wall time in seconds."""
        self.last_step = step
        self._progress_at = time.monotonic()
        entered_at, self._entered_at = self._entered_at, None
        events: list[Event] = []
        if not math.isfinite(loss):
            events.append(self.event(Kind.NAN_LOSS, iteration=step, loss=str(loss)))
        if not math.isfinite(step_time):
            return events  # no measurement: neither a straggler nor part of the baseline
        # Its own work: from the step's start (now - step_time) to its first collective.
        compute = None if entered_at is None else max(0.0, entered_at - (time.perf_counter() - step_time))
        if self._profiles is not None:
            # Its own work, not its wait: a rank waiting for a slow peer has not slowed itself.
            self._profiles.observe(step_time if compute is None else compute)
        if self.timings_every is not None:
            self._window.append((step, step_time, compute))
            consecutive = self._window[-1][0] - self._window[0][0] == len(self._window) - 1
            if not consecutive:
                self._window = self._window[-1:]  # a gap (a skipped report): peers compare by step
            elif len(self._window) >= self.timings_every:
                events.append(self._report_timings())
            return events  # peers judge this rank, not its own history
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

    def _report_timings(self) -> Event:
        window, self._window = self._window, []
        computes = [c for _, _, c in window]
        return self.event(
            Report.HEALTH_CHECK,
            iteration=window[-1][0],
            check=TIMINGS_CHECK,
            first_step=window[0][0],
            world_size=self.world_size,
            step_times_s=[round(t, 6) for _, t, _ in window],
            compute_s=None if None in computes else [round(c or 0.0, 6) for c in computes],
            artifacts_dir=None if self._profiles is None else str(self._profiles.folder),
        )

    def watch_for_stalls(self, after_s: float, directory: Path | str) -> threading.Thread:
        """Dump every thread's stack (faulthandler) into `directory` once no step has been reported
        for `after_s`, and report it: a hung rank rarely says anything else. Once per stalled step."""
        if not (math.isfinite(after_s) and after_s > 0):
            raise ValueError(f"after_s: must be a finite number > 0, not {after_s!r}")
        folder = Path(directory).absolute()  # a path GPU Medic can use, whatever this rank's cwd
        folder.mkdir(parents=True, exist_ok=True)
        watch = threading.Thread(
            target=self._watch_stalls, args=(after_s, folder), name="medic-stall-watch", daemon=True
        )
        watch.start()
        return watch

    def _watch_stalls(self, after_s: float, folder: Path) -> None:
        reported: int | None = None
        while True:
            time.sleep(after_s / 4)
            stalled_s = time.monotonic() - self._progress_at
            if stalled_s < after_s or self.last_step is None or reported == self.last_step:
                continue
            reported = step = self.last_step
            path = folder / f"{str(self.job)[:120]}-r{self.rank}-step{step}-stacks.txt"
            try:
                with path.open("w") as dump:
                    faulthandler.dump_traceback(dump, all_threads=True)
                self.event(
                    Report.HEALTH_CHECK,
                    iteration=step,
                    check=STALL_CHECK,
                    stalled_s=round(stalled_s, 3),
                    artifact=str(path),
                    collective_seq=self.collectives or None,
                    # Entered a collective this step and not come back to end it: waiting inside one,
                    # not in its own work before it (input, a checkpoint written by every rank).
                    in_collective=self._entered_at is not None,
                    world_size=self.world_size,
                    # Where the GPU got to, where tracked: a rank stuck in a kernel has issued its
                    # next collective without starting it, a place the loop's count cannot see.
                    flight_recorder=flight_recorder_status(),
                )
            except Exception:  # reporting never stops training, a watch thread least of all
                log.exception("could not report a stall of step %s", step)

    def profile_on_demand(
        self,
        directory: Path | str,
        *,
        steps: int = 3,
        cooldown_s: float = 1800.0,
        slowdown: Slowdown | None = None,
        poll_s: float = 5.0,
    ) -> None:
        """Let `profile_wanted()` ask for a profile of `steps` steps into `directory`: when this rank's
        own work has slowed (`slowdown`), at most once per slowdown and per `cooldown_s`; and whenever
        `<job>-r<rank>.profile-request` appears there (looked for every `poll_s`; it may hold
        `{"steps": N}`, and `"from_step": S` to start at step S exactly, so that ranks asked together
        profile the same steps; it is removed once taken, and one whose S is more than
        STALE_REQUEST_STEPS behind is dropped). Step-timing reports then carry the directory
        (`artifacts_dir`): where GPU Medic writes its requests."""
        if not 1 <= steps <= MAX_PROFILE_STEPS:
            raise ValueError(f"steps: must be 1-{MAX_PROFILE_STEPS}, not {steps!r}")
        if not (cooldown_s >= 0 and poll_s > 0 and math.isfinite(poll_s)):
            raise ValueError(f"cooldown_s must be >= 0 and poll_s finite > 0, not {cooldown_s!r}, {poll_s!r}")
        folder = Path(directory).absolute()  # a path GPU Medic can use, whatever this rank's cwd
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{str(self.job)[:120]}-r{self.rank}"
        self._profiles = ProfileTrigger(
            folder, name, steps, cooldown_s, slowdown or Slowdown(), poll_s, self.clock
        )

    def profile_wanted(self) -> ProfileRequest | None:
        """Call before each step: a request to profile the steps from the next one on, or None (cheap)."""
        if self._profiles is None:
            return None
        return self._profiles.wanted((self.last_step or 0) + 1)

    def profiled(self, request: ProfileRequest, first_step: int, last_step: int) -> Event | None:
        """Report the profile `request` asked for once the loop has written it; a capture that wrote
        nothing (it failed) is logged instead. Either way the next profile may be asked for."""
        assert self._profiles is not None  # only profile_wanted() makes requests
        self._profiles.taking = False
        if not request.path.is_file():
            log.warning(
                "no profile at %s (steps %s-%s); nothing reported", request.path, first_step, last_step
            )
            return None
        return self.event(
            Report.HEALTH_CHECK,
            iteration=last_step,
            check=PROFILE_CHECK,
            artifact=str(request.path),
            reason=request.reason,
            first_step=first_step,
            last_step=last_step,
            **request.figures,
        )

    def crash(self, exit_code: int) -> Event:
        """Call just before the process exits with a failure code."""
        code = operator.index(exit_code)  # numpy/torch ints too; the schema wants an integer
        event = self.event(Kind.JOB_CRASH, iteration=self.last_step, exit_code=int(code))
        self.flush()
        return event

    def flush(self, timeout_s: float = FLUSH_S) -> None:
        """Wait, at most `timeout_s`, for the sink to deliver what it queued (an HTTP sink; a file
        sink writes as it goes): before the process ends on a fault it reported."""
        flush = getattr(self.sink, "flush", None)  # a sink of the caller's own may have none
        if callable(flush):
            flush(timeout_s)

    def report_exception(self, error: BaseException) -> Event | None:
        """nccl_timeout for a collective timeout, job_crash (exit code 1) for anything else; once each."""
        if any(note.startswith(REPORTED_NOTE) for note in getattr(error, "__notes__", ())):
            return None
        what = {"error": type(error).__name__, "message": str(error)[:500]}
        if is_collective_timeout(error):
            # Where this rank was: the culprit of a hang is the rank that never got as far.
            where = {
                "collective_seq": self.collectives or None,
                "world_size": self.world_size,
                "flight_recorder": flight_recorder_status(),
            }
            event = self.event(Kind.NCCL_TIMEOUT, iteration=self.last_step, **what, **where)
        else:
            # 1 is the exit code Python gives an uncaught exception.
            event = self.event(Kind.JOB_CRASH, iteration=self.last_step, exit_code=1, **what)
        error.add_note(f"{REPORTED_NOTE}{event.kind.value} event {event.id}")
        self.flush()  # the exception is about to end the process, or its step
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
