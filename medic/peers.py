"""Peer comparison: which rank makes a synchronous job slow, judged against its peers in the same steps.

In data-parallel training every rank waits for the slowest at each collective, so a rank's wall
step time says little about it: one slow GPU slows every rank, and every rank's own history says
"straggler". What singles the culprit out is the time each rank spent before it entered the step's
collective (its compute, data loading included), compared with what the other ranks spent in the
same step. The training hooks report that per rank as `step_timings` windows (docs/culprit.md).

The rule, per job, over the last `window_steps` steps that every rank reported:
- a rank stands out in a step when its time is above the median of the other ranks' times in that
  step by more than `mad_k` of their (scaled) median absolute deviations: jitter among ranks that
  are alike is no outlier, one rank apart from a tight pack is;
- a rank is a straggler when it stood out in at least `steps_fraction` of the window's steps, its
  median ratio to its peers over the window is at least `ratio_at_least`, and fewer than half the
  ranks are stragglers: when most ranks are slower together the job itself slowed (input pipeline,
  checkpointing, a slower phase of the model), not a GPU, and nobody is named.
The confidence is the fraction of the window's steps in which it stood out.

Pure: events in, `straggler` events out (source `medic`, `attributes.detector: "peer"`).
"""

from __future__ import annotations

import hashlib
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from medic.events import EventKind, FaultEvent

TIMINGS_CHECK = "step_timings"  # the health_check `check` of a step-timings report
DETECTOR = "peer"
SOURCE = "medic"  # events GPU Medic derives itself
MAD_SCALE = 1.4826  # MAD x this estimates a normal distribution's standard deviation
HELD_WINDOWS = 4  # steps kept per job while some rank lags: room for reports to arrive out of step


class StepTimings(BaseModel):
    """The attributes of a `step_timings` report: one rank's times for consecutive steps."""

    model_config = ConfigDict(extra="allow", frozen=True)

    first_step: int = Field(ge=0)
    step_times_s: list[float] = Field(min_length=1, max_length=500)
    # Time from the step's start until the rank entered its first collective: its own work only.
    compute_s: list[float] | None = Field(default=None, max_length=500)
    world_size: int = Field(ge=1)

    def times(self) -> list[float]:
        """What peers are compared on: compute time where the loop reports collectives, else wall time."""
        if self.compute_s is not None and len(self.compute_s) == len(self.step_times_s):
            return self.compute_s
        return self.step_times_s


def timings_of(event: FaultEvent) -> StepTimings | None:
    """The step timings a report carries, or None when the event is no (usable) report."""
    if event.kind is not EventKind.HEALTH_CHECK or event.attributes.get("check") != TIMINGS_CHECK:
        return None
    if event.job is None or event.rank is None:
        return None
    try:
        return StepTimings.model_validate(event.attributes)
    except ValidationError:
        return None


@dataclass(frozen=True, slots=True)
class Thresholds:
    ratio_at_least: float = 1.2  # the default policy's straggler ratio
    mad_k: float = 3.0
    steps_fraction: float = 0.6
    window_steps: int = 20
    min_steps: int = 10  # fewer complete steps than this: no verdict yet
    min_peers: int = 2  # a rank needs at least this many others to be compared with


@dataclass(frozen=True, slots=True)
class Member:
    """Where one rank runs, as its own reports say."""

    node: str
    gpu: int | None
    switch: str | None


@dataclass(frozen=True, slots=True)
class Verdict:
    rank: int
    ratio: float  # median over the window of its time / the other ranks' median time
    confidence: float
    slow_steps: int
    steps: int
    rank_median_s: float
    peer_median_s: float


def others_spread(values: Sequence[float]) -> list[tuple[float, float]]:
    """For each value, the median of the others and their median absolute deviation from it: what
    `statistics.median` gives on the list without that value, to the bit, in O(n log n) for them
    all instead of O(n²). A 100,000-rank job is compared 100,000 times a step.

    Leaving one value out of n sorted ones, the median of the rest is one of at most three values
    (the left-out one below, at or above the middle); each has one sorted list of deviations, and
    leaving one deviation out of that is the same arithmetic again."""
    if len(values) < 2:
        raise statistics.StatisticsError("no other value to compare with")
    order = sorted(range(len(values)), key=values.__getitem__)
    ordered = [values[i] for i in order]
    at = _positions(order)
    medians = [_median_without(ordered, at[i]) for i in range(len(values))]
    spread: list[float] = [0.0] * len(values)
    for median in set(medians):
        deviations = [abs(v - median) for v in values]
        by_deviation = sorted(range(len(values)), key=deviations.__getitem__)
        sorted_deviations = [deviations[i] for i in by_deviation]
        where = _positions(by_deviation)
        for i in (i for i, m in enumerate(medians) if m == median):
            spread[i] = _median_without(sorted_deviations, where[i])
    return list(zip(medians, spread, strict=True))


def _positions(order: Sequence[int]) -> list[int]:
    """Where each index landed in `order` (the inverse permutation)."""
    where = [0] * len(order)
    for position, index in enumerate(order):
        where[index] = position
    return where


def _median_without(ordered: Sequence[float], skip: int) -> float:
    """`statistics.median` of sorted `ordered` without the item at `skip`."""
    n = len(ordered) - 1

    def item(k: int) -> float:
        return ordered[k if k < skip else k + 1]

    if n % 2:
        return item(n // 2)
    return (item(n // 2 - 1) + item(n // 2)) / 2


def judge(times: Mapping[int, Mapping[int, float]], thresholds: Thresholds) -> list[Verdict]:
    """The stragglers among the ranks, from {step: {rank: seconds}} where every step has every rank."""
    steps = sorted(times)
    ranks = sorted(times[steps[0]]) if steps else []
    if len(steps) < thresholds.min_steps or len(ranks) < thresholds.min_peers + 1:
        return []
    slow: dict[int, int] = defaultdict(int)
    ratios: dict[int, list[float]] = defaultdict(list)
    peer_medians: dict[int, list[float]] = defaultdict(list)
    for step in steps:
        row = times[step]
        values = [row[r] for r in ranks]
        for rank, mine, (median, deviation) in zip(ranks, values, others_spread(values), strict=True):
            mad = deviation * MAD_SCALE
            ratio = mine / median if median > 0 else 1.0
            ratios[rank].append(ratio)
            peer_medians[rank].append(median)
            if mine - median > thresholds.mad_k * mad:
                slow[rank] += 1
    stragglers = [
        r
        for r in ranks
        if slow[r] >= thresholds.steps_fraction * len(steps)
        and statistics.median(ratios[r]) >= thresholds.ratio_at_least
    ]
    if 2 * len(stragglers) >= len(ranks):
        return []  # most ranks slower than the rest: the job, not a GPU
    return [
        Verdict(
            rank=rank,
            ratio=round(statistics.median(ratios[rank]), 4),
            confidence=round(slow[rank] / len(steps), 3),
            slow_steps=slow[rank],
            steps=len(steps),
            rank_median_s=statistics.median(times[s][rank] for s in steps),
            peer_median_s=statistics.median(peer_medians[rank]),
        )
        for rank in stragglers
    ]


@dataclass(slots=True)
class _Job:
    world_size: int
    times: dict[int, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    judged_through: int = -1  # the newest complete step a verdict has covered
    dropped_incomplete: int = 0  # steps let go with ranks missing: reports that never came here


class PeerDetector:
    """Takes step-timings reports in arrival order and names stragglers as soon as a window completes.

    The last `window_steps` complete steps are judged whenever steps have completed (every rank
    reported them) since the last verdict and there are at least `min_steps`: one verdict per report
    round of the job. Memory per job is the last `window_steps` steps of every rank.
    """

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.thresholds = thresholds or Thresholds()
        self.jobs: dict[str, _Job] = {}
        self.members: dict[tuple[str, int], Member] = {}

    def push(self, event: FaultEvent) -> list[FaultEvent]:
        """Take one report (other events are ignored); the stragglers it completes a window for."""
        timings = timings_of(event)
        if timings is None:
            return []
        assert event.job is not None and event.rank is not None  # timings_of checks both
        job = self.jobs.get(event.job)
        if job is None or job.world_size != timings.world_size:
            job = self.jobs[event.job] = _Job(timings.world_size)  # a restart at another size: start over
        self.members[event.job, event.rank] = Member(event.node, event.gpu, event.switch)
        for offset, seconds in enumerate(timings.times()):
            job.times[timings.first_step + offset][event.rank] = seconds
        # A rank that stopped reporting leaves every step incomplete: keep a bounded backlog.
        for step in sorted(job.times)[: -HELD_WINDOWS * self.thresholds.window_steps]:
            job.dropped_incomplete += len(job.times.pop(step)) < job.world_size
        return self._judge(event.job, job, event.time)

    def never_complete(self) -> list[tuple[str, int, int]]:
        """Jobs never judged whose steps are let go with ranks missing, as (job, ranks in the newest
        step, world size): some ranks' reports go elsewhere (another replica) or nowhere, and this
        detector cannot name a straggler in them. Not "no straggler": nobody looked."""
        return [
            (name, len(job.times[max(job.times)]) if job.times else 0, job.world_size)
            for name, job in self.jobs.items()
            if job.dropped_incomplete and job.judged_through < 0
        ]

    def _judge(self, name: str, job: _Job, now: datetime) -> list[FaultEvent]:
        complete = sorted(s for s, row in job.times.items() if len(row) == job.world_size)
        if len(complete) < self.thresholds.min_steps or complete[-1] <= job.judged_through:
            return []
        window = complete[-self.thresholds.window_steps :]
        job.judged_through = window[-1]
        for step in [s for s in job.times if s < window[0]]:
            del job.times[step]
        verdicts = judge({s: job.times[s] for s in window}, self.thresholds)
        return [self._event(name, job, verdict, window, now) for verdict in verdicts]

    def _event(
        self, name: str, job: _Job, verdict: Verdict, window: Sequence[int], now: datetime
    ) -> FaultEvent:
        member = self.members[name, verdict.rank]
        attributes: dict[str, Any] = {
            "step_time_ratio": verdict.ratio,
            "detector": DETECTOR,
            "confidence": verdict.confidence,
            "peers": job.world_size - 1,
            "slow_steps": verdict.slow_steps,
            "window_steps": verdict.steps,
            "first_step": window[0],
            "last_step": window[-1],
            "rank_median_s": verdict.rank_median_s,
            "peer_median_s": verdict.peer_median_s,
        }
        return FaultEvent(
            id=derived_id(DETECTOR, name, verdict.rank, window[-1]),
            time=now,
            source=SOURCE,
            kind=EventKind.STRAGGLER,
            node=member.node,
            gpu=member.gpu,
            job=name,
            rank=verdict.rank,
            iteration=window[-1],
            switch=member.switch,
            attributes=attributes,
        )


def derived_id(detector: str, job: str, rank: int, at: int) -> str:
    """The same evidence gives the same id, so a replayed input dedupes instead of doubling."""
    digest = hashlib.sha256(f"{detector}\0{job}\0{rank}\0{at}".encode()).hexdigest()[:16]
    return f"{detector}-{digest}"


def detect(events: Iterable[FaultEvent], thresholds: Thresholds | None = None) -> list[FaultEvent]:
    """Every straggler event a stream of reports gives, in order."""
    detector = PeerDetector(thresholds)
    return [found for event in events for found in detector.push(event)]
