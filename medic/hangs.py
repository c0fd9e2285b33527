"""Hang attribution: when a collective times out, the rank that never entered it is the culprit.

A hung rank rarely reports anything: the ranks that do are waiting for it inside the collective,
and the node that reports a timeout is usually a victim. Each rank's hooks count the collectives
it entered (`attributes.collective_seq` on its `nccl_timeout`), and where the job runs PyTorch's
flight recorder, its process group's place there (`attributes.flight_recorder`); positions are
compared in one of those numberings, never across them.
The timeouts of one job are gathered for `settle` after the first, then:

- ranks behind: some reporters entered fewer collectives than the others. The ones furthest
  behind are the culprits (confidence: the share of reporters ahead of them);
- ranks absent: every reporter is at the same collective and a minority of the job's ranks (known
  from its earlier reports) never reported. Those are the culprits, with less confidence (a rank
  may also have been stopped before it could report): 0.8 x the share of the job that reported;
- otherwise (everyone stuck at the same collective, or most ranks silent) no rank is singled out
  and the timeouts go on as they came: a switch storm or a lone timeout, as the policy says.

A rank whose hooks watch for stalls reports one itself (a `health_check` with `check: stall`, its
collective count and a stack dump's path) when it stops making steps; such a report within
`STALL_LOOKBACK` of the timeouts gives the silent rank its position, and its dump becomes the
culprit's `artifact`.

The stall reports need not wait for a timeout (PyTorch's watchdog: 10 minutes by default). Every rank
of a hung job stalls, the hung one short of the collective its peers wait in, so the first stall
report of a job opens a gathering of its own, settled after `stall_settle` (the ranks' watches wake
a quarter of their period apart). Then only **behind** names a culprit: ranks at different positions.
Every rank of the job stalled at the same place, each inside the collective (issued, never completed:
a link or a switch between them), is **together**: the job is hung and no rank is to blame, and each
of its nodes gets the collective timeout the watchdog would have given it, minutes earlier (decision
0021). Everyone stalled at the same place outside a collective (a checkpoint written by all, a slow
input pipeline) names nobody and gives no event: the stalls stay evidence for a timeout to come. Nor
does a job that moved while its stalls gathered (a rank reported steps, or stalled a second time):
slow is not hung. A rank silent among stalled peers is not named from stalls alone (its report may be
late); the collective timeout finds it.

A culprit becomes one `nccl_timeout` event about its node (source `medic`, `attributes.detector:
"hang"`, its victims listed); the reporters' own timeouts are absorbed as its evidence, so no
victim's node is diagnosed or drained for the hang. Pure: events in, events out.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from medic.events import EventKind, FaultEvent
from medic.peers import SOURCE, Member, derived_id

DETECTOR = "hang"
TOGETHER = "hang-together"  # the ids of a whole job's hang: apart from any culprit's
SETTLE = timedelta(seconds=30)  # the reports of one hang come within the collective timeout's jitter
# Stall watches wake every quarter of their period: at the reference job's 30 s, every rank's report
# is in 7.5 s after the first, plus delivery.
STALL_SETTLE = timedelta(seconds=15)
STALL_CHECK = "stall"
STALL_LOOKBACK = timedelta(minutes=30)  # collective timeouts are minutes (NCCL's default: 10)
ABSENT_WEIGHT = 0.8  # silence is weaker evidence than a sequence number
MAX_VICTIMS_LISTED = 64  # attributes stay small whatever the job's size
FLIGHT_RECORDER_STATES = ("scheduled", "started", "completed")  # each implies the ones before it


class FlightRecorderPosition(BaseModel):
    """One rank's place in a process group, as PyTorch's flight recorder (`TORCH_FR_BUFFER_SIZE`, or
    `TORCH_NCCL_TRACE_BUFFER_SIZE` before it) keeps it: the dump's `pg_status` entry for the group,
    `last_enqueued_collective` (the rank issued it), `last_started_collective` (its kernel started;
    -1 where the backend does not track it, as gloo) and `last_completed_collective`."""

    model_config = ConfigDict(extra="allow", frozen=True)

    last_enqueued_collective: int = Field(ge=-1)
    last_started_collective: int = Field(default=-1, ge=-1)
    last_completed_collective: int = Field(default=-1, ge=-1)

    def position(self) -> int:
        """The last collective the rank entered: started where tracked (a GPU stuck in an earlier
        kernel has issued the next one but not started it), else issued."""
        started = self.last_started_collective
        return started if started >= 0 else self.last_enqueued_collective

    def inside(self) -> bool | None:
        """Whether the rank waits in a collective it entered and never completed; None where the
        recorder has completed none yet (not tracked, or the first collective)."""
        completed = self.last_completed_collective
        return None if completed < 0 else self.position() > completed


class TimeoutReport(BaseModel):
    """What a hook's `nccl_timeout` (or stall report) says of where its rank was."""

    model_config = ConfigDict(extra="allow", frozen=True)

    collective_seq: int | None = Field(default=None, ge=0)
    world_size: int | None = Field(default=None, ge=1)
    flight_recorder: FlightRecorderPosition | None = None
    in_collective: bool | None = None  # a stall report's: the hooks saw it enter a collective this step

    def inside(self) -> bool | None:
        """Waiting in a collective: the flight recorder's word where it has one, else the hooks'."""
        recorded = self.flight_recorder.inside() if self.flight_recorder else None
        return self.in_collective if recorded is None else recorded


def flight_recorder_position(dump: Mapping[str, Any], pg: str = "0") -> FlightRecorderPosition | None:
    """One process group's place in a rank's flight recorder dump (`_dump_fr_trace_json`; the default
    group is "0"): its `pg_status` where the dump has one, else worked out from its `entries`, each
    with a `pg_id`, a `collective_seq_id` and a `state` of `scheduled`, `started` or `completed`
    (point-to-point operations, `is_p2p`, are numbered apart and left out)."""
    status = dump.get("pg_status")
    if isinstance(status, Mapping) and isinstance(status.get(pg), Mapping):
        try:
            return FlightRecorderPosition.model_validate(status[pg])
        except ValidationError:
            return None
    entries = dump.get("entries")
    if not isinstance(entries, list):
        return None
    last: dict[str, int] = {}
    for entry in entries:
        if not isinstance(entry, Mapping) or entry.get("is_p2p") or str(entry.get("pg_id")) != pg:
            continue
        seq, state = entry.get("collective_seq_id"), entry.get("state")
        if isinstance(seq, bool) or not isinstance(seq, int):
            continue
        if state in FLIGHT_RECORDER_STATES:
            for reached in FLIGHT_RECORDER_STATES[: FLIGHT_RECORDER_STATES.index(state) + 1]:
                last[reached] = max(seq, last.get(reached, seq))
    if "scheduled" not in last:
        return None
    return FlightRecorderPosition(
        last_enqueued_collective=last["scheduled"],
        last_started_collective=last.get("started", -1),
        last_completed_collective=last.get("completed", -1),
    )


def _report(event: FaultEvent) -> TimeoutReport:
    try:
        return TimeoutReport.model_validate(event.attributes)
    except ValidationError:
        return TimeoutReport()  # says nothing of where it was


def _positions(reports: Mapping[int, TimeoutReport]) -> dict[int, int] | None:
    """Each rank's position, all in one numbering: the flight recorder's where every report has it
    (it counts every collective of the group, the hooks only those the loop told them of), else the
    hooks' counts; None when some report has neither."""
    recorded = {rank: r.flight_recorder.position() for rank, r in reports.items() if r.flight_recorder}
    if reports and len(recorded) == len(reports):
        return recorded
    counts = {rank: r.collective_seq for rank, r in reports.items() if r.collective_seq is not None}
    return counts if reports and len(counts) == len(reports) else None


@dataclass(frozen=True, slots=True)
class Culprit:
    rank: int
    position: int | None  # None: it never reported
    confidence: float
    evidence: str  # "behind" | "absent"


def attribute(positions: Mapping[int, int], world_size: int | None, known: set[int]) -> list[Culprit]:
    """The culprits, from each reporter's position and the ranks the job is known to have."""
    if not positions:
        return []
    ahead = max(positions.values())
    behind = min(positions.values())
    if behind < ahead:
        ahead_count = sum(1 for p in positions.values() if p > behind)
        confidence = round(ahead_count / len(positions), 3)
        return [Culprit(r, p, confidence, "behind") for r, p in sorted(positions.items()) if p == behind]
    ranks = set(range(world_size)) if world_size else known
    absent = sorted((ranks - set(positions)) & known)
    if not absent or len(ranks - set(positions)) * 2 >= len(positions):
        return []  # nobody missing, or too many silent ranks to single one out
    confidence = round(ABSENT_WEIGHT * len(positions) / len(ranks), 3)
    return [Culprit(rank, None, confidence, "absent") for rank in absent]


@dataclass(slots=True)
class _Pending:
    first: datetime
    reports: list[tuple[FaultEvent, TimeoutReport]] = field(default_factory=list)  # the timeouts
    stalled: set[int] = field(default_factory=set)  # ranks whose stall reports it has
    # A rank reported a step or a second stall since: the job moves, slowly or not, and is no hang.
    moved: bool = False


class HangAttributor:
    """Holds a job's collective timeouts for `settle`, then hands on its culprits (or the timeouts)."""

    def __init__(
        self,
        members: Mapping[tuple[str, int], Member],
        settle: timedelta = SETTLE,
        stall_settle: timedelta = STALL_SETTLE,
    ) -> None:
        self.members = members
        self.settle = settle
        self.stall_settle = stall_settle
        self.pending: dict[str, _Pending] = {}
        self.stalls: dict[tuple[str, int], tuple[FaultEvent, TimeoutReport]] = {}
        # (a reporter's timeout id, its culprit's event id) for the timeouts absorbed as evidence,
        # since the caller last took them.
        self.explained: list[tuple[str, str]] = []

    def takes(self, event: FaultEvent) -> bool:
        """A timeout that says where its rank was; any other is handed on as it came, unheld."""
        return (
            event.kind is EventKind.NCCL_TIMEOUT
            and event.job is not None
            and event.rank is not None
            and ("collective_seq" in event.attributes or "flight_recorder" in event.attributes)
            and "detector" not in event.attributes  # a culprit found already is not held again
        )

    def is_stall(self, event: FaultEvent) -> bool:
        return (
            event.kind is EventKind.HEALTH_CHECK
            and event.attributes.get("check") == STALL_CHECK
            and event.job is not None
            and event.rank is not None
        )

    def stalled(self, event: FaultEvent) -> None:
        """Keep a rank's stall report (`is_stall`) as evidence; the first of a job opens a gathering."""
        assert event.job is not None and event.rank is not None  # `is_stall` checks
        self.stalls[event.job, event.rank] = (event, _report(event))
        held = self.pending.setdefault(event.job, _Pending(event.time))
        # A hung job's ranks report once each: a second report is a rank that stepped on.
        held.moved |= event.rank in held.stalled
        held.stalled.add(event.rank)

    def progressed(self, job: str) -> None:
        """A rank of `job` reported finished steps (its step timings): no hang gathers for it now."""
        if job in self.pending:
            self.pending[job].moved = True

    def _due_at(self, held: _Pending) -> datetime:
        """Timeouts settle on theirs; a gathering of stalls alone on the stalls' shorter clock."""
        return held.first + (self.settle if held.reports else self.stall_settle)

    def push(self, event: FaultEvent) -> None:
        """Hold one timeout (`takes` it)."""
        assert event.job is not None  # `takes` checks
        held = self.pending.setdefault(event.job, _Pending(event.time))
        held.reports.append((event, _report(event)))

    def due(self, now: datetime) -> list[FaultEvent]:
        """What the jobs whose reports have settled by `now` give."""
        settled = [job for job, held in self.pending.items() if now >= self._due_at(held)]
        return [event for job in settled for event in self.release(job)]

    def flush(self) -> list[FaultEvent]:
        return [event for job in list(self.pending) for event in self.release(job)]

    def next_due(self) -> datetime | None:
        return min((self._due_at(p) for p in self.pending.values()), default=None)

    def release(self, job: str) -> list[FaultEvent]:
        held = self.pending.pop(job)
        if not held.reports:
            return [] if held.moved else self._from_stalls(job, since=held.first)
        events = [event for event, _ in held.reports]
        reported = {event.rank: report for event, report in held.reports if event.rank is not None}
        stalls = self._stalls_of(job, since=held.first - STALL_LOOKBACK)
        silent = {rank: report for rank, (_, report) in stalls.items() if rank not in reported}
        # A silent rank's own stall report counts where it is in the same numbering as the rest.
        positions = _positions(reported | silent) or _positions(reported)
        if positions is None:
            return events  # a reporter that cannot say where it was: no verdict on the others
        sizes = [r.world_size for _, r in held.reports if r.world_size]
        world = statistics.mode(sizes) if sizes else None
        known = {rank for name, rank in self.members if name == job}
        found = attribute(positions, world, known | set(positions))
        culprits = [c for c in found if (job, c.rank) in self.members]
        if not culprits:
            return events
        ahead = max(positions.values())
        stalled = {rank: event for rank, (event, _) in stalls.items()}
        named = [self._event(job, c, events, ahead, stalled.get(c.rank)) for c in culprits]
        self.explained.extend((event.id, named[0].id) for event in events)
        return named

    def _from_stalls(self, job: str, since: datetime) -> list[FaultEvent]:
        """The culprits among ranks stalled at different positions since `since`, before any timeout.
        The reports stay: evidence for the timeouts, should the job reach them."""
        stalls = {
            rank: found
            for (name, rank), found in self.stalls.items()
            if name == job and found[0].time >= since
        }
        positions = _positions({rank: report for rank, (_, report) in stalls.items()})
        if positions is None or len(positions) < 2:
            return []
        reports = sorted((event for event, _ in stalls.values()), key=lambda e: (e.time, e.id))
        ahead = max(positions.values())
        if min(positions.values()) == ahead:
            return self._together(job, stalls, ahead, reports)
        # Known ranks are the reporters: a silent rank is never named from stalls (module doc).
        found = attribute(positions, None, set(positions))
        culprits = [c for c in found if c.evidence == "behind" and (job, c.rank) in self.members]
        return [self._event(job, c, reports, ahead, stalls[c.rank][0], before_timeout=True) for c in culprits]

    def _together(
        self,
        job: str,
        stalls: Mapping[int, tuple[FaultEvent, TimeoutReport]],
        position: int,
        reports: list[FaultEvent],
    ) -> list[FaultEvent]:
        """Every rank of the job waiting inside the same collective: the job is hung and no rank is
        behind (a link, a switch, the collective itself). One event per node, as the watchdog's
        timeouts would come ten minutes later, and no culprit among them. Anything short of every
        rank, each known to wait inside the collective, names nothing: a rank that did not report
        may be the one behind, and ranks paused outside a collective are at their own work."""
        sizes = [report.world_size for _, report in stalls.values() if report.world_size]
        world = statistics.mode(sizes) if sizes else 0
        if world < 2 or set(stalls) != set(range(world)):
            return []
        if not all(report.inside() for _, report in stalls.values()):
            return []
        nodes: dict[str, list[int]] = {}
        for rank in sorted(stalls):
            nodes.setdefault(self.members[job, rank].node, []).append(rank)
        time, iteration = _latest(reports)
        events = []
        for node, ranks in nodes.items():
            member = self.members[job, ranks[0]]
            stall = stalls[ranks[0]][0]
            events.append(
                FaultEvent(
                    id=derived_id(TOGETHER, job, ranks[0], position),
                    time=time,
                    source=SOURCE,
                    kind=EventKind.NCCL_TIMEOUT,
                    node=node,
                    gpu=member.gpu if len(ranks) == 1 else None,  # the node's, not one GPU's
                    job=job,
                    rank=ranks[0],
                    iteration=iteration,
                    switch=member.switch,
                    attributes={
                        "detector": DETECTOR,
                        "evidence": "together",
                        "before_timeout": True,
                        "collective_seq": position,
                        "peers_collective_seq": position,
                        "ranks": ranks,
                        "world_size": world,
                        "reports": len(reports),
                        "nodes": len(nodes),
                        "stall_event": stall.id,
                        "artifact": stall.attributes.get("artifact"),
                    },
                )
            )
        return events

    def _stalls_of(self, job: str, since: datetime) -> dict[int, tuple[FaultEvent, TimeoutReport]]:
        """The job's stall reports since `since`, by rank; they are used up here."""
        mine = [key for key in self.stalls if key[0] == job]
        taken = {rank: self.stalls.pop((name, rank)) for name, rank in mine}
        return {rank: found for rank, found in taken.items() if found[0].time >= since}

    def _event(
        self,
        job: str,
        culprit: Culprit,
        reports: list[FaultEvent],
        ahead: int,
        stall: FaultEvent | None,
        before_timeout: bool = False,
    ) -> FaultEvent:
        member = self.members[job, culprit.rank]
        victims = [e for e in reports if e.rank != culprit.rank]
        time, iteration = _latest(reports)
        attributes: dict[str, Any] = {
            "detector": DETECTOR,
            "confidence": culprit.confidence,
            "evidence": culprit.evidence,
            "collective_seq": culprit.position,
            "peers_collective_seq": ahead,
            "reports": len(reports),
            "victim_count": len(victims),
            "victims": [
                {"rank": e.rank, "node": e.node, "event": e.id} for e in victims[:MAX_VICTIMS_LISTED]
            ],
        }
        if stall is not None:
            attributes |= {"stall_event": stall.id, "artifact": stall.attributes.get("artifact")}
        if before_timeout:
            attributes["before_timeout"] = True  # named from the ranks' stalls: no collective timed out yet
        return FaultEvent(
            id=derived_id(DETECTOR, job, culprit.rank, ahead),
            time=time,
            source=SOURCE,
            kind=EventKind.NCCL_TIMEOUT,
            node=member.node,
            gpu=member.gpu,
            job=job,
            rank=culprit.rank,
            iteration=iteration,
            switch=member.switch,
            attributes=attributes,
        )


def hung_jobs(events: Iterable[FaultEvent]) -> dict[str, datetime]:
    """The jobs named hung before their collectives timed out, each with the time it was named: left
    on their nodes, nothing but PyTorch's watchdog would end their hang, minutes later."""
    return {
        event.job: event.time
        for event in events
        if event.kind is EventKind.NCCL_TIMEOUT
        and event.job is not None
        and event.attributes.get("detector") == DETECTOR
        and event.attributes.get("before_timeout") is True
    }


def _latest(reports: list[FaultEvent]) -> tuple[datetime, int | None]:
    """A derived event's time and step: the last report's time, the furthest step reported."""
    last = max(reports, key=lambda e: (e.time, e.id))
    iterations = [e.iteration for e in reports if e.iteration is not None]
    return last.time, max(iterations) if iterations else None
