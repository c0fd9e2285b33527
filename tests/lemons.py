"""A simulated month of fleet history with planted lemons: does the ageing ranking find them?

Nodes run the jobs of several users in turn. Every GPU fails now and then at random, with the
failure mix of `failures` (Meta's Llama 3 table); a few planted lemons fail far more often, always
with a signature of their own hardware, and their error counters climb. Some jobs carry a bug of
their own that strikes again and again on one GPU: what a count of incidents alone mistakes for a
lemon. The events go through `medic triage`'s pipeline with a real policy (correlation, decisions,
so classifications), and `medic.ageing` ranks the nodes; `score` compares its top K with the truth.
Pure and seeded: the same parameters and seed give the same history.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from medic.ageing import COUNTERS_ATTRIBUTE, FleetHealth, PastIncident
from medic.events import EventKind, FaultEvent
from medic.policy import LoadedPolicy
from medic.triage import replay
from medic.whatif.fleetsim.failures import CAUSES, EventSpec, Nature, Signature, arrivals, draw

START = datetime(2026, 1, 1, tzinfo=UTC)
DAY_S = 86_400.0
_FROM_THE_JOB = frozenset({EventKind.NAN_LOSS, EventKind.JOB_CRASH, EventKind.NCCL_TIMEOUT})


@dataclass(frozen=True, slots=True, kw_only=True)
class LemonParams:
    nodes: int = 128
    gpus_per_node: int = 8
    days: float = 30.0
    lemons: int = 8  # on as many different nodes
    # A healthy GPU: ten times Llama 3's rate, so that chance repeats on one GPU do happen.
    gpu_mtbf_hours: float = 5_000.0
    lemon_mtbf_hours: float = 150.0
    jobs: int = 24
    owners: int = 8
    allocation_hours: float = 72.0  # how long a node stays with one job, on average
    buggy_jobs: int = 2  # jobs whose own bug strikes again and again on the GPU of one rank
    bug_mtbf_hours: float = 24.0


# What a lemon fails with: the signatures that name the GPU and that no job restart clears,
# weighted as in Meta's table.
_LEMON_FAULTS = [
    s
    for cause in CAUSES
    for s in cause.signatures
    if s.nature in (Nature.RESET, Nature.REBOOT, Nature.REPLACE) and any(e.gpu for e in s.events)
]
_LEMON_WEIGHTS = [c.interruptions * s.weight for c in CAUSES for s in c.signatures if s in _LEMON_FAULTS]
# A job's own bug: an XID 13 (a graphics exception in its kernel) on the GPU, and its crash.
_BUG = Signature(
    "application bug",
    1,
    (EventSpec(EventKind.XID, {"code": 13}), EventSpec(EventKind.JOB_CRASH, {"exit_code": 1}, gpu=False)),
    "crash",
    Nature.RESTART,
)


@dataclass(frozen=True, slots=True)
class History:
    events: tuple[FaultEvent, ...]
    owners: Mapping[str, str]  # job -> its owner
    lemons: frozenset[tuple[str, int]]  # (node, GPU)
    start: datetime
    end: datetime

    @property
    def lemon_nodes(self) -> frozenset[str]:
        return frozenset(node for node, _ in self.lemons)


@dataclass(frozen=True, slots=True)
class _Counters:
    """A GPU's counters: where each starts and how fast it climbs (per day)."""

    base: Mapping[str, int]
    per_day: Mapping[str, float]

    def at(self, days: float) -> dict[str, int]:
        return {name: self.base[name] + int(self.per_day[name] * days) for name in self.base}


def _counters(rng: random.Random, lemon: bool) -> _Counters:
    base = {
        "ecc_corrected": rng.randint(0, 50),
        "row_remap_corrected": rng.randint(0, 2),
        "nvlink_crc": rng.randint(0, 100),
    }
    if lemon:
        per_day = {
            "ecc_corrected": rng.uniform(15, 150),
            "row_remap_corrected": rng.uniform(0.1, 0.4) if rng.random() < 0.5 else 0.0,
            "nvlink_crc": rng.uniform(200, 2_000) if rng.random() < 0.5 else 0.0,
        }
    else:  # most stay flat; some creep, below what counts
        creep = rng.random() < 0.15
        per_day = {
            "ecc_corrected": rng.uniform(0, 3) if creep else 0.0,
            "row_remap_corrected": 0.0,
            "nvlink_crc": rng.uniform(0, 20),
        }
    return _Counters(base, per_day)


def _allocations(rng: random.Random, p: LemonParams, jobs: Sequence[str]) -> list[tuple[float, float, str]]:
    """One node's jobs in turn: (start, end, job), seconds from the start, covering the whole span."""
    spans, at, horizon = [], 0.0, p.days * DAY_S
    while at < horizon:
        end = min(horizon, at + rng.expovariate(1 / (p.allocation_hours * 3600)))
        spans.append((at, end, rng.choice(jobs)))
        at = end
    return spans


def simulate_history(p: LemonParams, seed: int) -> History:
    rng = random.Random(seed)
    horizon = p.days * DAY_S
    jobs = [f"job-{j:02d}" for j in range(p.jobs)]
    owners = {job: f"user-{rng.randrange(p.owners)}" for job in jobs}
    buggy = set(rng.sample(jobs, p.buggy_jobs))
    names = [f"gpu-node-{n:03d}" for n in range(p.nodes)]
    lemons = frozenset((node, rng.randrange(p.gpus_per_node)) for node in rng.sample(names, p.lemons))
    events: list[FaultEvent] = []
    for n, node in enumerate(names):
        allocations = _allocations(rng, p, jobs)
        for gpu in range(p.gpus_per_node):
            lemon = (node, gpu) in lemons
            counters = _counters(rng, lemon)
            faults = [(at, draw(rng)[1]) for at in arrivals(1 / (p.gpu_mtbf_hours * 3600), horizon, rng)]
            if lemon:
                rate = 1 / (p.lemon_mtbf_hours * 3600)
                faults += [
                    (at, rng.choices(_LEMON_FAULTS, _LEMON_WEIGHTS)[0]) for at in arrivals(rate, horizon, rng)
                ]
            if gpu == 0:  # rank 0 of whatever job the node runs: where a job's own bug strikes
                for start, end, job in allocations:
                    if job in buggy:
                        bugs = arrivals(1 / (p.bug_mtbf_hours * 3600), end - start, rng)
                        faults += [(start + at, _BUG) for at in bugs]
            for at, signature in faults:
                job = next(job for start, end, job in allocations if start <= at < end)
                events += _events(signature, node, n, gpu, job, at, counters)
    events.sort(key=lambda e: (e.time, e.id))
    return History(tuple(events), owners, lemons, START, START + timedelta(seconds=horizon))


def _events(
    signature: Signature, node: str, n: int, gpu: int, job: str, at: float, counters: _Counters
) -> list[FaultEvent]:
    """What our sources write for one fault, seconds apart; events about the GPU carry its counters."""
    reading = counters.at(at / DAY_S)
    made = []
    for i, spec in enumerate(signature.events):
        attributes = dict(spec.attributes)
        if spec.gpu:
            attributes[COUNTERS_ATTRIBUTE] = reading
        made.append(
            FaultEvent(
                id=f"{node}-{gpu}-{at:.3f}-{i}",
                time=START + timedelta(seconds=at + 2 * i),
                source="job" if spec.kind in _FROM_THE_JOB else "agent",
                kind=spec.kind,
                node=node,
                gpu=gpu if spec.gpu else None,
                job=job,
                rank=8 * n + gpu,
                attributes=attributes,
            )
        )
    return made


def incidents_of(history: History, loaded: LoadedPolicy) -> list[PastIncident]:
    """The history's incidents as the store would keep them: decided by the policy, owned by the
    owner of their job."""
    return [
        PastIncident.of(
            r.incident,
            r.decision.classification.value,
            next((history.owners[j] for j in r.incident.jobs), None),
        )
        for r in replay(history.events, loaded)
        if r.incident.scope == "node"
    ]


def by_incident_count(incidents: Sequence[PastIncident]) -> list[str]:
    """The baseline: nodes by their number of incidents, whatever the policy called them."""
    counts = Counter(i.node for i in incidents)
    return sorted(counts, key=lambda node: (-counts[node], node))


@dataclass(frozen=True, slots=True)
class Score:
    k: int
    precision: float  # of the top k nodes, the share with a lemon
    recall: float  # of the nodes with a lemon, the share in the top k
    gpu_named: float | None = None  # of the lemons found, the share whose node's worst GPU is the lemon


def score(ranked: Sequence[str], history: History, k: int) -> Score:
    found = set(ranked[:k]) & history.lemon_nodes
    return Score(k, len(found) / k, len(found) / len(history.lemon_nodes))


def score_health(health: FleetHealth, history: History, k: int) -> Score:
    """`score` for the ageing ranking, and whether it names the right GPU of each lemon it found."""
    top = health.nodes[:k]
    ranked = score([n.node for n in top], history, k)
    named = [(n.node, n.gpus[0].gpu) in history.lemons for n in top if n.node in history.lemon_nodes]
    return Score(ranked.k, ranked.precision, ranked.recall, sum(named) / len(named) if named else None)
