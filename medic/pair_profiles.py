"""Why is the straggler slow: its profile and a healthy peer's, asked for together (docs/culprit.md).

When the peer detector names a straggler, this asks its rank and one rank the detector did not name
(on another node where there is one) for a profile of the same `PAIR_STEPS` steps, starting a little
ahead of where the job is (`from_step`): a `ProfileAsk` per rank, which the caller writes as the
rank's request file in the directory its step-timing reports name (`artifacts_dir`). At most one
pair per job per `COOLDOWN`. When both ranks have reported the profiles asked for, the pair's traces
are handed out to be diffed (medic/profile_diff.py: file I/O and seconds of CPU, the caller's to
run), and the diff's verdict, given back, is carried from then on by the stragglers about the rank
(`straggler_cause` and its companions), as a rank's own profile is (medic/profiles.py).

A straggler about a pair's suspect waits for the verdict (docs/decisions/0024): held from the pair's
ask until the diff is in, so that no node is diagnosed, drained or left alone on a guess, at most
VERDICT_WAIT; past that it goes on as `unknown`, saying why, and the policy decides as it would
without a verdict. Other faults of the node are never held.

Pure: events and the diff's result in, requests, traces to diff and events out.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from medic.events import EventKind, FaultEvent
from medic.peers import Member, StepTimings
from medic.profile_diff import ProfileDiff
from medic.training.medic_hooks import PROFILE_REQUEST_SUFFIX, STALE_REQUEST_STEPS

PAIR_STEPS = 10  # as many as the benchmark's (BENCHMARKS.md): enough steps for a confident diff
COOLDOWN = timedelta(minutes=30)  # one pair per job in this time; a verdict holds as long
LEAD_WINDOWS = 2  # the pair starts at least two report windows past the latest step reported
# ... and at least this long after it: a rank looks for request files every 5 s (the hooks'
# profile_on_demand poll_s), and a request read after its first step is late or stale.
LEAD_S = 15.0
MAX_EVIDENCE = 5
# How long a straggler about a pair's suspect waits for the pair's verdict, from the ask: the lead
# (two report windows, at least LEAD_S), PAIR_STEPS profiled steps, both reports and a diff of seconds.
VERDICT_WAIT = timedelta(minutes=3)
REQUESTED = "requested"  # a profile report's `reason` when a request file asked for it


@dataclass(frozen=True, slots=True)
class ProfileAsk:
    """A request for one rank's profile: `steps` steps from `from_step` on, as its request file."""

    job: str
    rank: int
    folder: str  # the rank's `artifacts_dir`
    steps: int
    from_step: int

    @property
    def path(self) -> Path:
        # The hooks cut the job's name at 120 characters in the file names they look for.
        return Path(self.folder) / f"{self.job[:120]}-r{self.rank}{PROFILE_REQUEST_SUFFIX}"

    def body(self) -> str:
        return json.dumps({"steps": self.steps, "from_step": self.from_step})


@dataclass(frozen=True, slots=True)
class PairTraces:
    """Both profiles of a pair are in: the suspect's trace and its peer's, to diff."""

    job: str
    suspect_rank: int
    peer_rank: int
    suspect: Path
    peer: Path


@dataclass(frozen=True, slots=True)
class _Reported:
    """What a rank's latest step-timing report says about asking it for a profile."""

    folder: str | None
    last_step: int
    step_s: float  # the median wall time of its steps in that report
    window: int  # steps a report
    world_size: int  # a restart at another size leaves the old ranks' reports behind


@dataclass(slots=True)
class _Pair:
    suspect: int
    peer: int
    from_step: int
    asked_at: datetime
    traces: dict[int, str] = field(default_factory=dict)  # rank -> the trace it reported
    verdict: dict[str, object] | None = None
    verdict_at: datetime | None = None
    waiting: list[FaultEvent] = field(default_factory=list)  # stragglers about the suspect, held

    @property
    def deadline(self) -> datetime:
        return self.asked_at + VERDICT_WAIT


def verdict_attributes(diff: ProfileDiff, peer_trace: Path) -> dict[str, object]:
    """The diff as a straggler's attributes: its facts, its top evidence and the peer's trace."""
    evidence = [
        {
            # An operator with the shapes it ran at: the same ones slower is the device, others the code.
            "name": f"{growth.name} {growth.shapes}" if growth.shapes else growth.name,
            "category": str(growth.category),
            "grew_s": round(growth.growth_s, 6),
            "ratio": None if growth.ratio is None else round(growth.ratio, 3),
        }
        for growth in diff.evidence[:MAX_EVIDENCE]
    ]
    attributes = diff.facts() | {
        "straggler_cause_reason": diff.reason,
        "straggler_cause_evidence": evidence,
        "straggler_cause_peer_artifact": str(peer_trace),
    }
    # None is left out, as an event's validation leaves it out: the same event once stored and read back.
    return {key: value for key, value in attributes.items() if value is not None}


class PairProfiles:
    """Decides when to ask for a pair of profiles, matches their reports, and carries the verdict.

    `asking=False` (a file replayed by `medic triage`): nothing is asked, so nothing is diffed and
    the stragglers come out as they went in.
    """

    def __init__(self, members: dict[tuple[str, int], Member], *, asking: bool = False) -> None:
        self.members = members  # the ranks' places, shared with the differential
        self.asking = asking
        self.reported: dict[str, dict[int, _Reported]] = {}
        self.pairs: dict[str, _Pair] = {}  # the latest pair asked for, per job
        self.asks: list[ProfileAsk] = []  # to write; taken by take_asks()
        self.ready: list[PairTraces] = []  # to diff; taken by take_ready()
        self.released: list[FaultEvent] = []  # held stragglers whose verdict came; taken by due()

    def report(self, event: FaultEvent, timings: StepTimings) -> None:
        """Keep a rank's step-timing report: where its requests go and how far and fast it runs."""
        assert event.job is not None and event.rank is not None  # timings_of checks both
        folder = (timings.model_extra or {}).get("artifacts_dir")
        self.reported.setdefault(event.job, {})[event.rank] = _Reported(
            folder=folder if isinstance(folder, str) and Path(folder).is_absolute() else None,
            last_step=timings.first_step + len(timings.step_times_s) - 1,
            step_s=statistics.median(timings.step_times_s),
            window=len(timings.step_times_s),
            world_size=timings.world_size,
        )

    def ask(self, stragglers: list[FaultEvent]) -> None:
        """Ask for a pair about the most lagging straggler of each job, outside its job's cooldown."""
        if not self.asking:
            return
        by_job: dict[str, list[FaultEvent]] = {}
        for event in stragglers:
            if event.kind is EventKind.STRAGGLER and event.job is not None and event.rank is not None:
                by_job.setdefault(event.job, []).append(event)
        for job, named in by_job.items():
            previous = self.pairs.get(job)
            now = max(e.time for e in named)
            if previous is not None and now - previous.asked_at < COOLDOWN:
                continue
            suspect = max(
                named, key=lambda e: (float(e.attributes.get("step_time_ratio", 0)), -(e.rank or 0))
            )
            assert suspect.rank is not None
            self._ask(job, suspect.rank, {e.rank for e in named}, now)

    def _ask(self, job: str, suspect: int, named: set[int | None], now: datetime) -> None:
        mine = self.reported.get(job, {}).get(suspect)
        if mine is None or mine.folder is None:
            return  # its hooks take no requests: nowhere to ask
        ranks = {r: seen for r, seen in self.reported[job].items() if seen.world_size == mine.world_size}
        healthy = [r for r, seen in ranks.items() if r not in named and seen.folder is not None]
        if not healthy:
            return
        # Another node's rank first: a peer on the suspect's node shares whatever that node has.
        peer = min(healthy, key=lambda r: (self._node(job, r) == self._node(job, suspect), r))
        lead = max(LEAD_WINDOWS * mine.window, math.ceil(LEAD_S / mine.step_s) if mine.step_s > 0 else 0)
        start = max(seen.last_step for seen in ranks.values()) + lead
        self.pairs[job] = _Pair(suspect=suspect, peer=peer, from_step=start, asked_at=now)
        for rank in (suspect, peer):
            folder = ranks[rank].folder
            assert folder is not None
            self.asks.append(ProfileAsk(job, rank, folder, PAIR_STEPS, start))

    def _node(self, job: str, rank: int) -> str | None:
        member = self.members.get((job, rank))
        return None if member is None else member.node

    def profiled(self, event: FaultEvent) -> None:
        """Take a rank's profile report: once both of a pair's are in, its traces are ready to diff."""
        pair = self.pairs.get(event.job or "")
        artifact, first = event.attributes.get("artifact"), event.attributes.get("first_step")
        if pair is None or pair.verdict is not None or event.rank not in (pair.suspect, pair.peer):
            return
        if event.attributes.get("reason") != REQUESTED or not isinstance(artifact, str):
            return
        if not isinstance(first, int) or not 0 <= first - pair.from_step <= STALE_REQUEST_STEPS:
            return  # another profile: its own slowdown's, or an earlier request's
        if event.time < pair.asked_at or pair.traces.keys() == {pair.suspect, pair.peer}:
            return
        pair.traces[event.rank] = artifact
        if pair.traces.keys() == {pair.suspect, pair.peer}:
            assert event.job is not None
            self.ready.append(
                PairTraces(
                    job=event.job,
                    suspect_rank=pair.suspect,
                    peer_rank=pair.peer,
                    suspect=Path(pair.traces[pair.suspect]),
                    peer=Path(pair.traces[pair.peer]),
                )
            )
            pair.verdict_at = event.time

    def diagnosed(self, traces: PairTraces, diff: ProfileDiff) -> None:
        """The diff of a pair's traces: from now on the stragglers about its suspect carry it."""
        pair = self.pairs.get(traces.job)
        if pair is None or (pair.suspect, pair.peer) != (traces.suspect_rank, traces.peer_rank):
            return  # a newer pair replaced it while it was diffed
        pair.verdict = verdict_attributes(diff, traces.peer)
        self.released += pair.waiting
        pair.waiting = []

    def hold(self, event: FaultEvent) -> bool:
        """Keep a straggler about a pair's suspect until its verdict (or VERDICT_WAIT): True if held."""
        pair = self._suspects(event)
        if pair is None or pair.verdict is not None:
            return False
        if event.time > pair.deadline:
            self._give_up(pair)
            return False
        pair.waiting.append(event)
        return True

    def due(self, now: datetime) -> list[FaultEvent]:
        """The held stragglers to go on by `now`: those whose verdict came, and those of a pair whose
        wait ran out (its verdict then `unknown`)."""
        for pair in self.pairs.values():
            if pair.waiting and now >= pair.deadline:
                self._give_up(pair)
        out, self.released = self.released, []
        return out  # the caller attaches the verdict (`attach`), after the rank's own profile

    def flush(self) -> list[FaultEvent]:
        """Every straggler still held: the end of a file."""
        out, self.released = self.released, []
        for pair in self.pairs.values():
            out += pair.waiting
            pair.waiting = []
        return out

    def next_due(self) -> datetime | None:
        """When the next pair's wait runs out, if any holds a straggler."""
        return min((pair.deadline for pair in self.pairs.values() if pair.waiting), default=None)

    def _give_up(self, pair: _Pair) -> None:
        """No verdict within VERDICT_WAIT: the pair's stragglers go on as `unknown`, saying why."""
        if pair.verdict is None:
            missing = sorted({pair.suspect, pair.peer} - pair.traces.keys())
            why = (
                f"no profile from rank(s) {', '.join(map(str, missing))} within {VERDICT_WAIT.total_seconds():g} s"
                if missing
                else f"the pair's diff did not finish within {VERDICT_WAIT.total_seconds():g} s"
            )
            pair.verdict = {"straggler_cause": "unknown", "straggler_cause_reason": f"no verdict: {why}"}
            pair.verdict_at = pair.deadline
        self.released += pair.waiting
        pair.waiting = []

    def attach(self, event: FaultEvent) -> FaultEvent:
        """A straggler about a pair's suspect, with the pair's verdict while it holds (COOLDOWN)."""
        pair = self._suspects(event)
        if pair is None or pair.verdict is None or pair.verdict_at is None:
            return event
        if event.time - pair.verdict_at > COOLDOWN:
            return event
        return event.model_copy(update={"attributes": event.attributes | pair.verdict})

    def _suspects(self, event: FaultEvent) -> _Pair | None:
        """The pair whose suspect a straggler without a verdict of its own is about, if any."""
        if (
            event.kind is not EventKind.STRAGGLER
            or event.job is None
            or "straggler_cause" in event.attributes
        ):
            return None
        pair = self.pairs.get(event.job)
        return pair if pair is not None and event.rank == pair.suspect else None

    def take_asks(self) -> list[ProfileAsk]:
        asks, self.asks = self.asks, []
        return asks

    def take_ready(self) -> list[PairTraces]:
        ready, self.ready = self.ready, []
        return ready
