"""Why is this rank slow? Its profile against a healthy peer's, over the same steps (docs/culprit.md).

Peer comparison (medic/peers.py) names the rank the others wait for; this says what it spends the
extra time on, from two torch.profiler Chrome traces as the reference job writes them
(medic/training/profiling.py: `ProfilerStep#<step>` spans, operator shapes, Python functions):

- `summarize`: each profiled step's time, per category and per entry (an operator at its input
  shapes, a collective, a copy, the data loader, a Python function), with its calls;
- `compare`: the suspect's steps against the peer's same steps: what grew, by how much (seconds a
  step, ratio), how sure (the growth against its step-to-step spread), and the verdict it points
  to, with the entries that grew as its evidence.

The training thread's time in a step (and the GPU's) is split into self time (an event's time less
its children's), and each slice goes to the strongest category on its stack: a Python function's own code is
`python`, but a Python function the data loader called is `input`, and an operator inside a
collective is `communication`. Unknown is the answer whenever the traces cannot say, and it is
never called hardware or software. Pure: a trace's JSON in, pydantic models out.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from medic.errors import PermanentError

STEP_SPAN = re.compile(r"ProfilerStep#(\d+)$")
# The DataLoader's iterator marks each batch it hands out:
# `enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__` (or `_MultiProcessingDataLoaderIter`).
DATA_LOADER = "enumerate(DataLoader)#"
# c10d's operators (`c10d::allreduce_`), the backends' own marks (`gloo:all_reduce`, `nccl:all_reduce`)
# and NCCL's kernels (`ncclDevKernel_AllReduce_...`, `ncclKernel_...`).
COLLECTIVE = re.compile(r"^(c10d::|gloo:|nccl:|ncclDevKernel|ncclKernel|record_param_comms)")
NESTING_SLACK_US = 1.0
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
ADDRESS = re.compile(r" at 0x[0-9a-f]+")
COPY_OPS = frozenset({"aten::to", "aten::_to_copy", "aten::copy_"})


class ProfileError(PermanentError):
    """Raised when a file is not a torch.profiler Chrome trace with profiled steps in it."""


class Category(StrEnum):
    """Where a rank's time goes, strongest first: a slice of time goes to the strongest category on
    its stack, and between a copy and another operator to the outer one (aten::addmm's internal
    copy_ is compute; aten::to's is the copy)."""

    INPUT = "input"  # the data loader handing out a batch
    COMMUNICATION = "communication"  # collectives: c10d, gloo, NCCL
    COPY = "copy"  # host<->device copies: aten::to/_to_copy/copy_, cudaMemcpy*, GPU memcpy
    COMPUTE = "compute"  # operators on the host, kernels on the GPU
    PYTHON = "python"  # a Python function's own code
    OTHER = "other"  # builtins (C code called from Python), the CUDA runtime, the job's own marks


STRENGTH = {
    Category.INPUT: 0,
    Category.COMMUNICATION: 1,
    Category.COPY: 2,
    Category.COMPUTE: 2,
    Category.PYTHON: 3,
    Category.OTHER: 4,
}


class Cause(StrEnum):
    HARDWARE_COMPUTE = "hardware-compute"
    HARDWARE_IO = "hardware-io"
    COMMUNICATION = "communication"
    SOFTWARE_INPUT = "software-input"
    SOFTWARE_PYTHON = "software-python"
    NONE = "none"  # the same steps cost the same: nothing grew
    UNKNOWN = "unknown"  # something grew, or the traces cannot be read, and nothing names it

    @property
    def hardware(self) -> bool:
        return self in (Cause.HARDWARE_COMPUTE, Cause.HARDWARE_IO)

    @property
    def software(self) -> bool:
        return self in (Cause.SOFTWARE_INPUT, Cause.SOFTWARE_PYTHON)


class _Event(BaseModel):
    """One complete event ("ph": "X") of a Chrome trace, as torch.profiler writes it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ph: str
    name: str
    cat: str = ""
    ts: float
    dur: float = Field(ge=0)
    tid: int | str
    pid: int | str = 0
    args: dict[str, Any] = Field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.ts + self.dur


class Entry(BaseModel):
    """One thing a step spent time on: its category, its name and, for an operator, its input shapes."""

    model_config = ConfigDict(frozen=True)

    category: Category
    name: str
    shapes: str = ""  # the operator's "Input Dims", as the trace writes them

    @property
    def key(self) -> str:
        return f"{self.category}|{self.name}|{self.shapes}"


class Spent(BaseModel):
    model_config = ConfigDict(frozen=True)

    seconds: float
    calls: int


class StepSummary(BaseModel):
    model_config = ConfigDict(frozen=True)

    step: int
    seconds: float  # the step's span on the training thread
    categories: dict[Category, float]  # seconds of the training thread's and the GPU's time
    entries: dict[str, Spent]  # by Entry.key
    names: dict[str, Entry]  # Entry.key -> the entry


class ProfileSummary(BaseModel):
    model_config = ConfigDict(frozen=True)

    steps: list[StepSummary]

    def by_step(self) -> dict[int, StepSummary]:
        return {s.step: s for s in self.steps}


def _category(event: _Event) -> Category | None:
    """The event's own category; None for one that only passes its stack's category on."""
    name, cat = event.name, event.cat
    if cat == "user_annotation" and name.startswith(DATA_LOADER):
        return Category.INPUT
    if COLLECTIVE.match(name):
        return Category.COMMUNICATION
    if cat == "gpu_memcpy" or name in COPY_OPS or name.startswith("cudaMemcpy"):
        return Category.COPY
    if cat == "cpu_op" or cat in DEVICE_CATS:
        return Category.COMPUTE
    if cat == "python_function":
        # A builtin is C code: the autograd engine's run_backward, with DDP's wait for its
        # all-reduce inside, or a sleep. Its own time is no Python function's.
        return Category.OTHER if name.startswith("<built-in") else Category.PYTHON
    return None


def _name(name: str) -> str:
    """The event's name without the object addresses Python writes into a method's (`... at 0x7f..>`),
    which differ from one process to the next."""
    return ADDRESS.sub("", name)


def _shapes(event: _Event) -> str:
    dims = event.args.get("Input Dims")
    return json.dumps(dims, separators=(",", ":")) if dims else ""


class _Frame:
    """An event on a thread's stack, cut to its step: the category and the entry its own time goes to."""

    def __init__(self, event: _Event, start: float, end: float, parent: _Frame | None) -> None:
        self.event, self.start, self.end = event, start, end
        self.children_s = 0.0
        own = _category(event)
        if parent is None:
            self.category = own or Category.OTHER
        elif own is not None and (
            STRENGTH[own] < STRENGTH[parent.category]
            or (own is Category.OTHER and parent.category is Category.PYTHON)
        ):
            self.category = own
        else:
            self.category = parent.category
        # The entry is the outermost event of its category (the operator, not its internals), except
        # in Python, where it is the function whose own code runs.
        python = own is Category.PYTHON and self.category is Category.PYTHON
        self.counts = parent is None or parent.category is not self.category or python
        if self.counts:
            self.entry = Entry(category=self.category, name=_name(event.name), shapes=_shapes(event))
        else:
            assert parent is not None
            self.entry = parent.entry


def _load(document: Mapping[str, Any]) -> list[_Event]:
    raw = document.get("traceEvents")
    if not isinstance(raw, list):
        raise ProfileError("not a Chrome trace: no traceEvents list")
    try:
        return [_Event.model_validate(e) for e in raw if isinstance(e, dict) and e.get("ph") == "X"]
    except ValidationError as error:
        raise ProfileError(f"not a torch.profiler trace: {error.errors()[0]['msg']}") from error


def summarize(document: Mapping[str, Any]) -> ProfileSummary:
    """Each `ProfilerStep#N` span's time, per category and entry, on the training thread and the GPU."""
    events = _load(document)
    spans = sorted((int(m.group(1)), e) for e in events if (m := STEP_SPAN.match(e.name)) is not None)
    if not spans:
        raise ProfileError("no ProfilerStep#N spans: not a profile of training steps")
    # The training thread's time (the one that marks the steps) and the GPU's: a background thread
    # (a stall watch, a backend's worker) sleeps or waits alongside, and its time is no step's.
    training = {(e.pid, e.tid) for _, e in spans}
    threads: dict[tuple[int | str, int | str], list[_Event]] = defaultdict(list)
    for event in events:
        place = (event.pid, event.tid)
        if STEP_SPAN.match(event.name) is None and (place in training or event.cat in DEVICE_CATS):
            threads[place].append(event)
    return ProfileSummary(steps=[_step(step, span, threads.values()) for step, span in spans])


def _step(step: int, span: _Event, threads: Iterable[list[_Event]]) -> StepSummary:
    categories: dict[Category, float] = defaultdict(float)
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    names: dict[str, Entry] = {}

    def book(frame: _Frame) -> None:
        own_s = max(0.0, frame.end - frame.start - frame.children_s) / 1e6
        key = frame.entry.key
        names[key] = frame.entry
        categories[frame.category] += own_s
        seconds[key] += own_s
        calls[key] += frame.counts

    for thread in threads:
        # Every event that overlaps the step, cut to it: a function that encloses the loop counts
        # for its own time inside the step, none outside.
        inside = [
            (max(e.ts, span.ts), min(e.end, span.end), e)
            for e in thread
            if e.ts < span.end and e.end > span.ts
        ]
        inside.sort(key=lambda cut: (cut[0], cut[0] - cut[1]))  # a parent before the children it starts with
        stack: list[_Frame] = []
        for start, end, event in inside:
            # An event that outlasts the top of the stack is not its child: record_function's mark
            # starts inside the Python call that opens it (`_record_function_enter_new`) and ends long
            # after. Within a microsecond it is clock rounding, and the child ends with its parent.
            while stack and (start >= stack[-1].end or end > stack[-1].end + NESTING_SLACK_US):
                book(stack.pop())
            parent = stack[-1] if stack else None
            if parent is not None:
                end = min(end, parent.end)
                parent.children_s += end - start
            stack.append(_Frame(event, start, end, parent))
        while stack:
            book(stack.pop())
    return StepSummary(
        step=step,
        seconds=span.dur / 1e6,
        categories=dict(categories),
        entries={k: Spent(seconds=seconds[k], calls=calls[k]) for k in seconds},
        names=names,
    )


# The largest trace a diff reads (uncompressed): about 8 s of reading on this project's 2-core machine
# (a 39 MB trace and a 4 MB one diffed in 3.5 s, BENCHMARKS.md). A larger one is `unknown`, saying so.
MAX_TRACE_BYTES = 96 * 2**20


def read_summary(path: Path) -> ProfileSummary:
    """The summary of the Chrome trace at `path`, gzipped where it ends in .gz as torch's
    TensorBoard handler writes it with use_gzip (ProfileError when it is not one, or when it is
    larger than MAX_TRACE_BYTES: a diff must take seconds, and a rank's Python can make its trace
    hundreds of MB)."""
    try:
        with path.open("rb") as file:
            stream = gzip.GzipFile(fileobj=file) if path.suffix == ".gz" else file
            raw = stream.read(MAX_TRACE_BYTES + 1)
    except (OSError, EOFError) as error:
        raise ProfileError(f"cannot read the trace {path}: {error}") from error
    if len(raw) > MAX_TRACE_BYTES:
        raise ProfileError(
            f"the trace {path} is over the {MAX_TRACE_BYTES / 2**20:g} MiB a diff reads "
            "(its Python stacks, or too many steps); not diffed"
        )
    try:
        document = json.loads(raw)
    except ValueError as error:
        raise ProfileError(f"cannot read the trace {path}: {error}") from error
    if not isinstance(document, dict):
        raise ProfileError(f"{path}: not a Chrome trace object")
    return summarize(document)


class Thresholds(BaseModel):
    """What counts as grown (docs/culprit.md, "Why a rank is slow")."""

    model_config = ConfigDict(frozen=True)

    min_steps: int = Field(default=3, ge=2)  # common steps needed for a verdict
    min_growth_s: float = Field(default=0.0005, ge=0)  # 0.5 ms a step: below this, timer noise
    min_share: float = Field(default=0.05, ge=0)  # and 5% of the peer's step
    min_ratio: float = Field(default=1.2, ge=1)  # and 20% over the peer's own time in that category
    z: float = Field(default=3.0, gt=0)  # growth at least z standard errors of the step-to-step spread
    dominance: float = Field(default=0.5, gt=0, le=1)  # the verdict's category: this share of all growth
    same_calls: float = Field(default=0.1, ge=0)  # "the same operators": calls a step within 10%


class Growth(BaseModel):
    """How one category or entry compares on the common steps: medians of per-step values."""

    model_config = ConfigDict(frozen=True)

    category: Category
    name: str = ""  # empty for a whole category
    shapes: str = ""
    suspect_s: float  # seconds a step on the suspect
    peer_s: float
    growth_s: float  # median over the steps of (suspect - peer)
    ratio: float | None  # suspect_s / peer_s; None where the peer spent nothing on it
    suspect_calls: float = 0.0  # calls a step
    peer_calls: float = 0.0
    confidence: float  # 1 - standard error / growth: how far the growth stands above its spread
    significant: bool


class ProfileDiff(BaseModel):
    """The differential's answer: a cause, how sure, why, and the figures behind it."""

    model_config = ConfigDict(frozen=True)

    cause: Cause
    confidence: float
    reason: str
    steps: list[int]  # the profiled steps both traces have
    suspect_step_s: float | None = None  # median step time
    peer_step_s: float | None = None
    categories: list[Growth] = Field(default_factory=list)  # every category, most grown first
    evidence: list[Growth] = Field(default_factory=list)  # the entries that grew most

    def facts(self) -> dict[str, object]:
        """The verdict as facts a policy can read (`straggler_cause` and its companions)."""
        top = self.evidence[0] if self.evidence else None
        return {
            "straggler_cause": str(self.cause),
            "straggler_cause_confidence": round(self.confidence, 3),
            "straggler_cause_hardware": self.cause.hardware,
            "straggler_cause_where": top.name if top is not None and self.cause is not Cause.NONE else None,
        }


def _growth(
    category: Category,
    suspect: Sequence[float],
    peer: Sequence[float],
    peer_step_s: float,
    limits: Thresholds,
    entry: Entry | None = None,
    calls: tuple[Sequence[int], Sequence[int]] = ((), ()),
) -> Growth:
    deltas = [s - p for s, p in zip(suspect, peer, strict=True)]
    grown = statistics.median(deltas)
    spread = 1.4826 * statistics.median(abs(d - grown) for d in deltas)  # MAD, as a standard deviation
    error = spread / math.sqrt(len(deltas))
    suspect_s, peer_s = statistics.median(suspect), statistics.median(peer)
    ratio = suspect_s / peer_s if peer_s > 0 else None
    significant = (
        grown >= max(limits.min_growth_s, limits.min_share * peer_step_s)
        and (ratio is None or ratio >= limits.min_ratio)
        and grown >= limits.z * error
    )
    return Growth(
        category=category,
        name=entry.name if entry else "",
        shapes=entry.shapes if entry else "",
        suspect_s=suspect_s,
        peer_s=peer_s,
        growth_s=grown,
        ratio=ratio,
        suspect_calls=statistics.median(calls[0]) if calls[0] else 0.0,
        peer_calls=statistics.median(calls[1]) if calls[1] else 0.0,
        confidence=max(0.0, 1 - error / grown) if grown > 0 else 0.0,
        significant=significant,
    )


def compare(suspect: ProfileSummary, peer: ProfileSummary, limits: Thresholds | None = None) -> ProfileDiff:
    """The suspect's profile against a healthy peer's, step for step, and the cause it points to."""
    limits = limits or Thresholds()
    mine, theirs = suspect.by_step(), peer.by_step()
    steps = sorted(mine.keys() & theirs.keys())
    if len(steps) < limits.min_steps:
        return ProfileDiff(
            cause=Cause.UNKNOWN,
            confidence=0.0,
            reason=f"{len(steps)} profiled steps in common (steps {sorted(mine)} against {sorted(theirs)}); "
            f"{limits.min_steps} needed",
            steps=steps,
        )
    a, b = [mine[s] for s in steps], [theirs[s] for s in steps]
    peer_step_s = statistics.median(s.seconds for s in b)
    categories = sorted(
        (
            _growth(
                c,
                [s.categories.get(c, 0.0) for s in a],
                [s.categories.get(c, 0.0) for s in b],
                peer_step_s,
                limits,
            )
            for c in Category
        ),
        key=lambda g: -g.growth_s,
    )
    names = {k: e for s in a + b for k, e in s.names.items()}
    entries = sorted(
        (
            _growth(
                entry.category,
                [s.entries[k].seconds if k in s.entries else 0.0 for s in a],
                [s.entries[k].seconds if k in s.entries else 0.0 for s in b],
                peer_step_s,
                limits,
                entry,
                (
                    [s.entries[k].calls if k in s.entries else 0 for s in a],
                    [s.entries[k].calls if k in s.entries else 0 for s in b],
                ),
            )
            for k, entry in names.items()
        ),
        key=lambda g: -g.growth_s,
    )
    # The peer's own work (all but its collectives) over the suspect's: positive where the "suspect"
    # is the one waiting, on a peer slower than it.
    own = [c for c in Category if c is not Category.COMMUNICATION]
    waits = _growth(
        Category.COMMUNICATION,
        [sum(s.categories.get(c, 0.0) for c in own) for s in b],
        [sum(s.categories.get(c, 0.0) for c in own) for s in a],
        peer_step_s,
        limits,
    )
    # Time in collectives and in builtins together: on the CPU, DDP waits for its all-reduce inside
    # the autograd engine's run_backward (a builtin: `other`) on one rank and inside c10d::allreduce_
    # on the other. Where the two together did not grow, the wait only moved from one to the other.
    pair = (Category.COMMUNICATION, Category.OTHER)
    moved = not _growth(
        Category.COMMUNICATION,
        [sum(s.categories.get(c, 0.0) for c in pair) for s in a],
        [sum(s.categories.get(c, 0.0) for c in pair) for s in b],
        peer_step_s,
        limits,
    ).significant
    cause, reason, evidence = _verdict(categories, entries, limits, waits.significant, moved)
    top = next(g for g in categories if g.category is evidence[0].category) if evidence else None
    return ProfileDiff(
        cause=cause,
        confidence=top.confidence
        if top is not None and cause is not Cause.UNKNOWN
        else _quiet(categories, cause, moved),
        reason=reason,
        steps=steps,
        suspect_step_s=statistics.median(s.seconds for s in a),
        peer_step_s=peer_step_s,
        categories=categories,
        evidence=evidence or [g for g in entries if g.growth_s > 0][:5],
    )


def _quiet(categories: Sequence[Growth], cause: Cause, wait_moved: bool) -> float:
    """Confidence in `none`: how far the largest growth is from standing out (a wait that only moved
    between ranks aside); unknown is never sure."""
    if cause is not Cause.NONE:
        return 0.0
    moved = (Category.COMMUNICATION, Category.OTHER) if wait_moved else ()
    return 1 - max((g.confidence for g in categories if g.category not in moved), default=0.0)


def _verdict(
    categories: Sequence[Growth],
    entries: Sequence[Growth],
    limits: Thresholds,
    peer_slower: bool,
    wait_moved: bool,
) -> tuple[Cause, str, list[Growth]]:
    # The suspect's own work first: its collectives are mostly waiting (on 2 shared cores, for the
    # CPU too), and a slow rank waits less, not more. Communication is the cause only when nothing
    # of its own grew.
    stands_out = [
        g
        for g in categories
        if g.significant and not (wait_moved and g.category in (Category.COMMUNICATION, Category.OTHER))
    ]
    grown = [g for g in stands_out if g.category is not Category.COMMUNICATION] or stands_out
    if not grown:
        return Cause.NONE, "no category grew on the suspect beyond its step-to-step spread", []
    top = grown[0]
    total = sum(g.growth_s for g in grown)  # noise that did not stand out weighs nothing
    if top.growth_s < limits.dominance * total:
        listed = ", ".join(f"{g.category} +{g.growth_s * 1e3:.2f} ms" for g in grown)
        return Cause.UNKNOWN, f"no one category dominates the growth ({listed})", []
    mine = [g for g in entries if g.category is top.category and g.growth_s > 0]
    # The entries that make up half the category's growth, biggest first: what the verdict rests on.
    evidence: list[Growth] = []
    for entry in mine:
        evidence.append(entry)
        if sum(e.growth_s for e in evidence) >= top.growth_s / 2:
            break
    shown = f"{top.category} +{top.growth_s * 1e3:.2f} ms a step"
    if top.category is Category.INPUT:
        return Cause.SOFTWARE_INPUT, f"{shown}: the suspect waits on its data loader", evidence
    if top.category is Category.PYTHON:
        if len(evidence) != 1:
            return (
                Cause.UNKNOWN,
                f"{shown}, spread over {len(evidence)} Python functions, none named",
                evidence,
            )
        return Cause.SOFTWARE_PYTHON, f"{shown}, in {evidence[0].name}", evidence
    if top.category is Category.COMMUNICATION:
        if peer_slower:
            return Cause.UNKNOWN, f"{shown}: waiting on a peer whose own work is longer", evidence
        return Cause.COMMUNICATION, f"{shown}, its compute equal to the peer's", evidence
    if top.category in (Category.COMPUTE, Category.COPY):
        cause = Cause.HARDWARE_COMPUTE if top.category is Category.COMPUTE else Cause.HARDWARE_IO
        more = [e for e in evidence if not _same_calls(e, limits)]
        if more:
            listed = ", ".join(f"{e.name} {e.suspect_calls:g} calls against {e.peer_calls:g}" for e in more)
            return (
                Cause.UNKNOWN,
                f"{shown} from more or other calls than the peer's ({listed}): software doing more work, not a slower device",
                evidence,
            )
        return cause, f"{shown}: the same operators at the same shapes, slower", evidence
    return (
        Cause.UNKNOWN,
        f"{shown}, outside any operator, collective, copy, input or Python function",
        evidence,
    )


def _same_calls(entry: Growth, limits: Thresholds) -> bool:
    if entry.peer_calls <= 0:
        return False
    return abs(entry.suspect_calls / entry.peer_calls - 1) <= limits.same_calls


def diagnose(suspect: Path, peer: Path, limits: Thresholds | None = None) -> ProfileDiff:
    """`compare` on two trace files; one that cannot be read gives `unknown`, never a cause."""
    try:
        summaries = read_summary(suspect), read_summary(peer)
    except ProfileError as error:
        return ProfileDiff(cause=Cause.UNKNOWN, confidence=0.0, reason=str(error), steps=[])
    return compare(*summaries, limits)
