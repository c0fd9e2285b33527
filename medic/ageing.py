"""Hardware ageing across jobs: which nodes are likely to fail next, and on what evidence.

Pure: the store's incidents and the counter readings its events carry in, a ranking out
(docs/fleet-health.md). A GPU that fails again and again, for different jobs and different users,
with its error counters climbing, is wearing out; one that failed once, or only ever in one job's
code, is not. Each piece of evidence adds points to a score, and the points are kept beside the
score, so that a person can check why a node ranks where it does.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import combinations
from typing import Any

from pydantic import BaseModel, ConfigDict

from medic.events import FaultEvent
from medic.incidents import Incident

SCHEMA_VERSION = 1
SOFTWARE = "software"  # incidents the policy blamed on the application say nothing of the hardware
COUNTERS_ATTRIBUTE = "counters"  # where the node agent puts a GPU's counters on its events

# The counters the node agent reads from NVML (docs/events.md), and the rise per day from which
# each one counts as evidence: a healthy GPU's stay flat or creep, so these sit well above a creep.
TREND_PER_DAY: Mapping[str, float] = {
    "ecc_corrected": 10.0,  # corrected (single-bit) ECC errors, the GPU's lifetime count
    "ecc_uncorrected": 0.1,  # uncorrected (double-bit): one every ten days is already a lot
    "row_remap_corrected": 0.1,  # HBM rows remapped; spare rows run out
    "row_remap_uncorrected": 0.1,
    "nvlink_crc": 100.0,  # NVLink flit and data CRC errors, summed over the links
}

# The score's weights (docs/fleet-health.md#the-score).
REPEAT_POINTS = 1.0  # each bout of incidents on the same GPU after the first
JOB_POINTS = 1.0  # each job among them after the first: the fault follows the GPU, not the code
OWNER_POINTS = 0.5  # each owner (user) among them after the first
TREND_POINTS_MAX = 2.0  # a rising counter: its rate over its threshold, from 1 up to this
# The node as a whole (its incidents, whatever GPU they named, if any): eight GPUs, the host and
# the network fail together by chance more often than one GPU does.
NODE_WEIGHT = 0.5
# Incidents less than this after the one before are one bout: a burst within hours is one bad day
# (the policy's to handle), while wear shows as failures coming back day after day.
BOUT_GAP = timedelta(days=1)
# A counter's trend needs readings spread over at least this long: two readings a minute apart
# make any difference look like a steep rise.
MIN_TREND_SPAN = timedelta(days=1)
# Readings beyond this many per counter are thinned evenly: the median of pairwise slopes costs n².
MAX_TREND_READINGS = 60


@dataclass(frozen=True, slots=True)
class PastIncident:
    """An incident as ageing sees it: where, when, which GPUs its events named, whose jobs, and
    what the policy called it (None: not decided yet)."""

    id: str
    node: str
    opened_at: datetime
    gpus: tuple[int, ...] = ()
    jobs: tuple[str, ...] = ()
    owner: str | None = None
    classification: str | None = None

    @property
    def blames_hardware(self) -> bool:
        return self.classification != SOFTWARE

    @classmethod
    def of(
        cls, incident: Incident, classification: str | None = None, owner: str | None = None
    ) -> PastIncident:
        gpus = sorted({e.gpu for e in incident.events if e.gpu is not None})
        return cls(
            incident.id,
            incident.node,
            incident.opened_at,
            tuple(gpus),
            tuple(incident.jobs),
            owner,
            classification,
        )


@dataclass(frozen=True, slots=True)
class Reading:
    """One GPU's counters at one moment, as an event carried them."""

    node: str
    gpu: int
    time: datetime
    counters: Mapping[str, int]

    @classmethod
    def of(
        cls, node: str, gpu: int | None, time: datetime, attributes: Mapping[str, Any] | None
    ) -> Reading | None:
        """The reading an event's attributes carry, if any: only whole, non-negative counts count."""
        raw = (attributes or {}).get(COUNTERS_ATTRIBUTE)
        if gpu is None or not isinstance(raw, Mapping):
            return None
        counters = {
            name: value
            for name, value in raw.items()
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0
        }
        return cls(node, gpu, time, counters) if counters else None


def readings_of(events: Iterable[FaultEvent]) -> list[Reading]:
    return [r for e in events if (r := Reading.of(e.node, e.gpu, e.time, e.attributes)) is not None]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Evidence(_Frozen):
    points: float
    why: str


class Trend(_Frozen):
    counter: str
    per_day: float  # the median of the slopes between every two readings (Theil-Sen)
    threshold_per_day: float
    readings: int
    first: int  # the counter at the first and the last reading
    last: int


class GpuHealth(_Frozen):
    gpu: int | None  # None: the node as a whole, all its incidents
    score: float
    incidents: int
    jobs: list[str]
    owners: list[str]
    first_at: datetime | None
    last_at: datetime | None
    mtbi_hours: float | None  # mean time between its incidents; None below two
    trends: list[Trend]
    evidence: list[Evidence]


class NodeHealth(_Frozen):
    rank: int
    node: str
    score: float  # its worst GPU's, or the whole node's if higher
    incidents: int
    mtbi_hours: float | None
    gpus: list[GpuHealth]  # its GPUs with any evidence, and the node as a whole (gpu null), the worst first


class FleetHealth(_Frozen):
    """`medic fleet health --json` (docs/fleet-health.md#json): a field is only ever added."""

    schema_version: int = SCHEMA_VERSION
    since: datetime
    until: datetime
    incidents: int  # counted: in the window, not blamed on the application
    nodes_scored: int  # nodes with any evidence; `nodes` lists the first `--top` of them
    nodes: list[NodeHealth]


def theil_sen(points: Sequence[tuple[float, float]]) -> float:
    """The median slope between every two points of different x: one reset or burst cannot tilt it."""
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in combinations(points, 2) if x2 != x1]
    return statistics.median(slopes)


def _thinned(items: Sequence[tuple[datetime, int]], most: int) -> Sequence[tuple[datetime, int]]:
    if len(items) <= most:
        return items
    return [items[round(i * (len(items) - 1) / (most - 1))] for i in range(most)]


def trends(readings: Sequence[Reading]) -> list[Trend]:
    """Each counter's rise per day over one GPU's readings (any order), where they span long enough."""
    series: dict[str, list[tuple[datetime, int]]] = defaultdict(list)
    for reading in sorted(readings, key=lambda r: r.time):
        for name, value in reading.counters.items():
            if name in TREND_PER_DAY:
                series[name].append((reading.time, value))
    found = []
    for name, points in sorted(series.items()):
        if points[-1][0] - points[0][0] < MIN_TREND_SPAN:
            continue
        start = points[0][0]
        days = [((t - start) / timedelta(days=1), float(v)) for t, v in _thinned(points, MAX_TREND_READINGS)]
        found.append(
            Trend(
                counter=name,
                per_day=round(theil_sen(days), 2),
                threshold_per_day=TREND_PER_DAY[name],
                readings=len(points),
                first=points[0][1],
                last=points[-1][1],
            )
        )
    return found


@dataclass(slots=True)
class _Subject:
    """One GPU of a node, or the node as a whole, and what was seen of it."""

    incidents: list[PastIncident] = field(default_factory=list)
    readings: list[Reading] = field(default_factory=list)


def _mtbi_hours(times: Sequence[datetime]) -> float | None:
    if len(times) < 2:
        return None
    return round((max(times) - min(times)) / timedelta(hours=1) / (len(times) - 1), 1)


def bouts(times: Sequence[datetime]) -> int:
    """How many bursts sorted `times` form, a new one beginning a BOUT_GAP or more after the last."""
    return sum(1 for i, t in enumerate(times) if i == 0 or t - times[i - 1] >= BOUT_GAP)


def _gpu_health(gpu: int | None, subject: _Subject) -> GpuHealth:
    incidents = sorted(subject.incidents, key=lambda i: i.opened_at)
    jobs = sorted({j for i in incidents for j in i.jobs})
    owners = sorted({i.owner for i in incidents if i.owner})
    where = "this node" if gpu is None else f"GPU {gpu}"
    times = [i.opened_at for i in incidents]
    mtbi, bursts = _mtbi_hours(times), bouts(times)
    found = trends(subject.readings)
    points: list[tuple[float, str]] = []
    if bursts > 1:
        points.append(
            (
                REPEAT_POINTS * (bursts - 1),
                f"{len(incidents)} incidents on {where} in {bursts} bouts a day or more apart, "
                f"{mtbi:g} h apart on average",
            )
        )
    if len(jobs) > 1:
        points.append((JOB_POINTS * (len(jobs) - 1), f"{len(jobs)} jobs: {', '.join(jobs)}"))
    if len(owners) > 1:
        points.append((OWNER_POINTS * (len(owners) - 1), f"{len(owners)} owners: {', '.join(owners)}"))
    for trend in found:
        if trend.per_day >= trend.threshold_per_day:
            points.append(
                (
                    min(TREND_POINTS_MAX, trend.per_day / trend.threshold_per_day),
                    f"{trend.counter} rising {trend.per_day:g}/day ({trend.first} to {trend.last}; "
                    f"threshold {trend.threshold_per_day:g}/day)",
                )
            )
    weight = NODE_WEIGHT if gpu is None else 1.0
    evidence = [Evidence(points=round(p * weight, 2), why=why) for p, why in points]
    return GpuHealth(
        gpu=gpu,
        score=round(sum(e.points for e in evidence), 2),
        incidents=len(incidents),
        jobs=jobs,
        owners=owners,
        first_at=incidents[0].opened_at if incidents else None,
        last_at=incidents[-1].opened_at if incidents else None,
        mtbi_hours=mtbi,
        trends=found,
        evidence=evidence,
    )


def assess(
    incidents: Iterable[PastIncident],
    readings: Iterable[Reading],
    since: datetime,
    until: datetime,
    top: int | None = None,
) -> FleetHealth:
    """Every node with evidence in [since, until], the likeliest to fail next first; `top` keeps
    the first so many. Incidents the policy called `software` do not count."""
    subjects: dict[str, dict[int | None, _Subject]] = defaultdict(lambda: defaultdict(_Subject))
    counted = [i for i in incidents if i.blames_hardware and since <= i.opened_at <= until]
    for incident in counted:
        for subject in (*incident.gpus, None):  # each GPU it named, and the node
            subjects[incident.node][subject].incidents.append(incident)
    for reading in readings:
        if since <= reading.time <= until:
            subjects[reading.node][reading.gpu].readings.append(reading)
    nodes = []
    for node, by_subject in subjects.items():
        health = [_gpu_health(gpu, s) for gpu, s in by_subject.items()]
        scored = sorted(
            (h for h in health if h.score > 0),
            key=lambda h: (-h.score, -h.incidents, h.gpu is None, h.gpu or 0),
        )
        if scored:
            whole = by_subject.get(None, _Subject()).incidents
            nodes.append((node, scored, whole))
    nodes.sort(key=lambda n: (-n[1][0].score, -len(n[2]), n[0]))
    shown = nodes if top is None else nodes[:top]
    return FleetHealth(
        since=since,
        until=until,
        incidents=len(counted),
        nodes_scored=len(nodes),
        nodes=[
            NodeHealth(
                rank=rank,
                node=node,
                score=scored[0].score,
                incidents=len(mine),
                mtbi_hours=_mtbi_hours([i.opened_at for i in mine]),
                gpus=scored,
            )
            for rank, (node, scored, mine) in enumerate(shown, start=1)
        ],
    )
