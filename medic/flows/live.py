"""The warm path: events `medic serve` has stored become incidents and flow runs in this process.

A new event joins its node's incident while that incident is still being handled, by this
process or another replica (the store keeps one active incident per node), so the running flow
sees the new evidence at its next decision instead of a second flow run starting. A switch-wide
storm's events join its switch's incident even once it was handled, while the storm goes on
within the policy's window. Everything else is correlated into new incidents, each remediated by
its own flow run on a worker thread (flows run sync tasks; the service's event loop must stay
free to acknowledge events).

Each run holds its incident's lease (medic/flows/leases.py). Every `pickup_every` seconds, and at
start, the service claims the incidents still being handled that no live run holds (a replica
or a predecessor killed mid-run) and runs them again from their last recorded step, after
settling the node actions a crash left without an outcome (medic/tasks/nodes/reconcile.py). It also sends
again the chat messages such a process left in the store's outbox (medic/tasks/notify.py).

Before any of that, events pass the differential (medic/culprit.py): step timings become the
stragglers their peers reveal, a hang's timeouts become its culprit's (held `settle` seconds for
the reports to come in), and events without a switch get their node's leaf from the scheduler.
What it derives is stored before it is correlated, like every event. When it names a straggler,
the rank and a healthy peer are asked for a profile of the same steps (a request file each, written
here), and once both are reported their diff (medic/profile_diff.py) runs on a worker thread; the
stragglers about that rank carry its verdict from then on (docs/culprit.md).

Events a policy `switch` condition counts (collective timeouts, say) are held for
`defaults.storm_hold_seconds` first: the first node to report a switch failure reports it
alone, and deciding on it before its neighbours do would take a healthy node out. Held events
are already stored, so a restart hands them on again from the backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Self

import anyio

from medic.culprit import Differential
from medic.events import EventKind, FaultEvent
from medic.facts import facts_of
from medic.flows.dispatch import remediate_one, stored
from medic.flows.leases import Leases, runner_name
from medic.incidents import Incident, Storms, correlate
from medic.pair_profiles import PairTraces, ProfileAsk
from medic.policy import decide
from medic.profile_diff import Cause, ProfileDiff, diagnose
from medic.statuses import ACTIVE_INCIDENT_STATUSES, TERMINAL_INCIDENT_STATUSES
from medic.store.tables import IncidentRecord
from medic.tasks.runtime import prefect_events
from medic.tasks.nodes.contain import CONTAINED, contain
from medic.tasks.nodes.evidence import storms
from medic.tasks.nodes.guard import ensure_limits
from medic.tasks.notify import redeliver
from medic.tasks.nodes.reconcile import reconcile_intents
from medic.tasks.runtime.process import Runtime
from medic.topology import Topology

log = logging.getLogger("medic.live")
TOPOLOGY_REFRESH_S = 600.0  # switches change with recabling, not by the minute
CONTAIN_CONCURRENCY = 4
CONTAIN_FIRST_MAX_S = 60.0


class LiveDispatcher:
    def __init__(self, rt: Runtime, leases: Leases | None = None, max_concurrent: int = 8) -> None:
        self.rt = rt
        self.leases = leases if leases is not None else Leases(rt.store, runner_name("live"))
        self._limiter = anyio.CapacityLimiter(max_concurrent)
        self._tasks: set[asyncio.Task[None]] = set()
        self._held: dict[str, list[FaultEvent]] = {}
        self._correlating = asyncio.Lock()
        self._warming: threading.Thread | None = None
        self.differential = Differential(ask_profiles=True)
        self._differing = threading.Lock()  # batches and the settle timer take turns in worker threads
        self._topology_until = 0.0
        self._settling = False
        self._never_complete: set[str] = set()  # jobs warned about (_warn_never_complete)
        # Containment first: a burst's drains are the seconds that count, and every flow run
        # started beside them takes CPU from them (BENCHMARKS.md, "At fleet scale"). New flow runs
        # wait while any containment is pending; the containments go a few at a time, so the
        # first ones finish first instead of all finishing late together, and those whose own
        # events already say "take the node out" go before those that will most likely leave it.
        self._containing = 0
        self._contained = asyncio.Event()
        self._contained.set()
        self._contain_turns = Turns(CONTAIN_CONCURRENCY)

    async def warm_up(self) -> None:
        """Start Prefect's API (embedded or remote) before the first fault needs it."""
        await ensure_limits()

    def warm_up_in_background(self) -> None:
        """Warm up on a thread of its own (the embedded API takes seconds to start); flow runs
        wait for it, since one started before the API answers fails to reach it."""
        self._warming = threading.Thread(target=lambda: asyncio.run(self.warm_up()), daemon=True)
        self._warming.start()

    async def __call__(self, events: list[FaultEvent]) -> None:
        # What people did to a node is stored evidence only: no incident, no run (docs/decisions/0019).
        events = [e for e in events if e.kind is not EventKind.NODE_STATE]
        if not events:
            return
        found, pairs = await anyio.to_thread.run_sync(self._diagnose, events)
        for traces in pairs:
            self._spawn(functools.partial(anyio.to_thread.run_sync, self._diff, traces))
        await self._take(found)
        self._settle_later()

    async def _take(self, events: list[FaultEvent]) -> None:
        policy = self.rt.policy().policy
        counted = policy.storms().counts
        now = [e for e in events if not counted(e)]
        if now:
            await self._open(now)
        for event in events:
            if counted(event):
                self._hold(event, policy.defaults.storm_hold_seconds)

    async def start(self, incident: Incident) -> None:
        """Remediate one incident whose lease this process holds: here, a flow run in this process."""
        if self._warming is not None:
            await anyio.to_thread.run_sync(self._warming.join)
        try:
            await anyio.to_thread.run_sync(_run_flow, self.rt, incident, limiter=self._limiter)
        except Exception:  # one incident's failure must not stop the service
            log.exception("remediation of %s failed", incident.id)
        finally:
            self.leases.release(incident.id)

    async def pickup(self) -> int:
        """Run every incident still being handled that no live run holds; returns how many.

        Its node actions that a crash left without an outcome are settled first, from the
        provider's record (medic/tasks/nodes/reconcile.py), so the run knows what was done. Chat messages a
        process that is gone left unsent go out again before anything a run picked up now says."""
        await anyio.to_thread.run_sync(redeliver, self.rt)
        claimed = [stored(record) for record in await anyio.to_thread.run_sync(self.leases.pickup)]
        if claimed:
            ids = {incident.id for incident in claimed}
            for line in await anyio.to_thread.run_sync(reconcile_intents, self.rt, ids):
                log.info("reconciled %s", line)
        for incident in claimed:
            log.warning("picking up incident %s on %s: no live run held it", incident.id, incident.node)
            self._spawn(functools.partial(self.start, incident))
        return len(claimed)

    async def pickup_forever(self, every_s: float) -> None:
        while True:
            try:
                await self.pickup()
            except Exception:  # the store or a provider is down: try again next time
                log.exception("picking up orphaned incidents failed")
            await asyncio.sleep(every_s)

    async def drain(self) -> None:
        """Wait for held events and the flow runs started so far (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        """Stop renewing this process's leases (at shutdown): what is still held lapses for a
        replica's pickup instead of being renewed by a process that no longer runs it."""
        self.leases.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _spawn(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        task = asyncio.create_task(work())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _diagnose(self, events: list[FaultEvent]) -> tuple[list[FaultEvent], list[PairTraces]]:
        """The events to correlate, and the pairs of profiles now ready to diff."""
        with self._differing:
            if time.monotonic() >= self._topology_until:
                self._topology_until = time.monotonic() + TOPOLOGY_REFRESH_S
                try:
                    self.differential.topology = Topology.of_nodes(self.rt.backends.scheduler.nodes())
                except Exception:  # the scheduler is down: the switches it said last will do
                    log.exception("reading the topology from the scheduler failed")
            # The policy, re-read as for every incident, says how long a job's stalls gather.
            settle = self.rt.policy().policy.defaults.stall_settle_seconds
            self.differential.hangs.stall_settle = timedelta(seconds=settle)
            out = self._stored(events, [out for event in events for out in self.differential.push(event)])
            self._warn_never_complete()
            asks, ready = self.differential.pairs.take_asks(), self.differential.pairs.take_ready()
        write_asks(asks, self.rt.artifact_root)
        return out, ready

    def _warn_never_complete(self) -> None:
        """Say so, once per job, when a job's step timings never all reach this process: a load
        balancer that spreads a job's reports over the replicas leaves each a share, and peer
        comparison needs every rank's (route them by the hooks' X-Medic-Job header, docs/serve.md)."""
        for job, seen, world in self.differential.peers.never_complete():
            if job not in self._never_complete:
                self._never_complete.add(job)
                log.warning(
                    "job %s: only %d of its %d ranks' step timings reach this process, so no "
                    "straggler can be named in it; send a job's reports to one replica "
                    "(route on the X-Medic-Job header)",
                    job,
                    seen,
                    world,
                )

    def _diff(self, traces: PairTraces) -> None:
        """Diff a pair's traces (seconds of CPU, outside the lock: intake goes on meanwhile)."""
        diff = diff_pair(traces, self.rt.artifact_root)
        log.info(
            "profile diff of %s rank %s: %s (%s)", traces.job, traces.suspect_rank, diff.cause, diff.reason
        )
        with self._differing:
            self.differential.pairs.diagnosed(traces, diff)

    def _settled(self) -> list[FaultEvent]:
        with self._differing:
            return self._stored([], self.differential.due(datetime.now(UTC)))

    def _stored(self, given: list[FaultEvent], out: list[FaultEvent]) -> list[FaultEvent]:
        given_ids = {e.id for e in given}
        self.rt.store.record_accepted(e for e in out if e.id not in given_ids)  # derived: a culprit
        # What the differential absorbed as evidence is in no incident: marked, a start does not hand
        # it on again (the culprit it was absorbed into is stored above, before it is named).
        self.rt.store.mark_explained(self.differential.take_explained())
        return out

    def _settle_later(self) -> None:
        """Hand on held collective timeouts once they settle: one timer at a time."""
        due = self.differential.next_due()
        if due is None or self._settling:
            return
        self._settling = True

        async def release() -> None:
            await asyncio.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds()))
            self._settling = False
            await self._take(await anyio.to_thread.run_sync(self._settled))
            self._settle_later()

        self._spawn(release)

    def _hold(self, event: FaultEvent, seconds: float) -> None:
        switch = event.switch or ""
        held = self._held.setdefault(switch, [])
        if not held:

            async def release() -> None:
                await asyncio.sleep(seconds)
                mine = self._held.pop(switch)
                await self._open(mine + await anyio.to_thread.run_sync(self._held_elsewhere, switch, mine))

            self._spawn(release)
        held.append(event)

    def _held_elsewhere(self, switch: str, mine: list[FaultEvent]) -> list[FaultEvent]:
        """The storm's events that other replicas stored and still hold. A load balancer gives each
        replica a share of a switch's events, and a share of a storm may fall under the policy's
        `fraction_at_least` where the whole is over it: each replica would open node incidents for
        a switch's trouble (BENCHMARKS.md, "At fleet scale", burst (c)). Whichever replica opens
        the switch's incident first ties them all; the others' then join it."""
        policy = self.rt.policy().policy
        since = min(e.time for e in mine) - timedelta(minutes=policy.defaults.incident_window_minutes)
        held = {e.id for e in mine}
        found = self.rt.store.unassigned_on_switch(switch, policy.storms().kinds, since)
        return [e for e in found if e.id not in held]

    async def _open(self, events: list[FaultEvent]) -> None:
        async with self._correlating:  # a release and a new batch must not both open an incident
            # Abandoned, not awaited, when the service stops: the events are stored already and the
            # next start takes them up again, while waiting here (on a Prefect API that is starting
            # or gone) would hold the shutdown past its 10 s.
            incidents = await anyio.to_thread.run_sync(self._incidents, events, abandon_on_cancel=True)
            # One at a time, those that take their node out first, each contained as soon as it is
            # opened: a batch of many requests' events must not hold its first drain until every
            # incident in it is open.
            for incident in sorted(incidents, key=self.urgency):
                mine = await anyio.to_thread.run_sync(self._open_one, incident, abandon_on_cancel=True)
                if mine is not None:
                    self._spawn(functools.partial(self._contain_then_start, mine))

    async def _contain_then_start(self, incident: Incident) -> None:
        """Drain the node first where the decision takes it out (medic/tasks/nodes/contain.py), then start its
        run; a containment that fails leaves the work to the run, which drains as it always has."""
        if self._warming is not None:
            await anyio.to_thread.run_sync(self._warming.join)  # the guardrail slot lives on the API
        self._containing += 1
        self._contained.clear()
        try:
            await ensure_limits()  # made by the warm-up, unless the API was not there yet
            async with self._contain_turns.turn(self.urgency(incident)):
                await anyio.to_thread.run_sync(contain, self.rt, incident.id, incident.node, incident.scope)
        except Exception:
            log.exception("containment of %s on %s failed; its flow run goes on", incident.id, incident.node)
        finally:
            self._containing -= 1
            if not self._containing:
                self._contained.set()
        with anyio.move_on_after(CONTAIN_FIRST_MAX_S):  # a burst that never ends must not stall the runs
            await self._contained.wait()
        await self.start(incident)

    def urgency(self, incident: Incident) -> int:
        """0 for an incident whose first answer, from its own events alone, takes the node out; 1
        for the rest. Only the order of the containments: each is decided in full all the same."""
        try:
            guess = decide(self.rt.policy().policy, facts_of(incident, now=datetime.now(UTC)))
        except Exception:  # cannot tell: urgent
            return 0
        return 0 if guess.action in CONTAINED else 1

    def _correlate(self, events: list[FaultEvent]) -> list[Incident]:
        """Open (or join) the incidents for these events; returns those this process now runs."""
        opened = (self._open_one(incident) for incident in self._incidents(events))
        return [incident for incident in opened if incident is not None]

    def _incidents(self, events: list[FaultEvent]) -> list[Incident]:
        """The incidents these events make, once those of a storm still going on joined it."""
        policy = self.rt.policy().policy
        window = timedelta(minutes=policy.defaults.incident_window_minutes)
        current = policy.storms()
        if any(current.counts(e) for e in events):
            current = storms(self.rt)  # the scheduler's switch sizes, asked only when they matter
        return correlate(self._join_storms(events, window, current), window, current)

    def _open_one(self, incident: Incident) -> Incident | None:
        """Open (or join) one incident; the incident when this process now runs it."""
        window = timedelta(minutes=self.rt.policy().policy.defaults.incident_window_minutes)
        row, opened = self.rt.store.open_or_join(
            incident, runner=self.leases.runner, lease_s=self.leases.lease_s, window=window
        )
        if opened:
            self.leases.hold(row.id)
            prefect_events.incident_opened(incident)
            return incident
        if self.leases.claim(row.id):
            # It joined an incident whose run died: new evidence never waits on a dead run.
            return stored(row)
        return None

    def _join_storms(self, events: list[FaultEvent], window: timedelta, current: Storms) -> list[FaultEvent]:
        """Attach a storm's events to its switch's incident while the storm goes on; return the rest."""
        switches = {e.switch for e in events if current.counts(e) and e.switch}
        storming = {s: found for s in switches if (found := self._switch_incident(s)) is not None}
        by_switch: dict[str, list[FaultEvent]] = defaultdict(list)
        fresh: list[FaultEvent] = []
        for event in sorted(events, key=lambda e: (e.time, e.id)):
            if current.counts(event) and event.switch in storming:
                by_switch[event.switch].append(event)
            else:
                fresh.append(event)
        for switch, switch_events in by_switch.items():
            active = storming[switch]
            joined = _within(switch_events, active.last_event_at, window)
            if joined:
                extra = Incident(id=active.id, node=switch, events=joined, scope="switch")
                self.rt.store.open_incident(extra)
            joined_ids = {e.id for e in joined}
            fresh.extend(e for e in switch_events if e.id not in joined_ids)
        return sorted(fresh, key=lambda e: (e.time, e.id))

    def _switch_incident(self, switch: str) -> IncidentRecord | None:
        # A switch's storm goes on after its incident is handed to the network team; until it
        # has been quiet for a window, more of it is more evidence, not a second incident.
        statuses = ACTIVE_INCIDENT_STATUSES | TERMINAL_INCIDENT_STATUSES
        return self.rt.store.find_active_incident(switch, statuses, "switch")


class Turns:
    """At most `size` at a time; those waiting go in by priority (lower first), then by arrival."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @contextlib.asynccontextmanager
    async def turn(self, priority: int) -> AsyncIterator[None]:
        if self._free and not self._waiting:
            self._free -= 1
        else:
            called: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (priority, next(self._arrivals), called))
            try:
                await called
            except asyncio.CancelledError:
                if called.done() and not called.cancelled():
                    self._next()  # given a turn as it was cancelled: pass it on
                raise
        try:
            yield
        finally:
            self._next()

    def _next(self) -> None:
        while self._waiting:
            _, _, called = heapq.heappop(self._waiting)
            if not called.done():
                called.set_result(None)
                return
        self._free += 1


def _within(events: list[FaultEvent], last: datetime, window: timedelta) -> list[FaultEvent]:
    """The events (time-sorted) that keep coming within `window` of the incident's last one."""
    joined = []
    for event in events:
        if event.time - last <= window:
            joined.append(event)
            last = max(last, event.time)
    return joined


def under(path: Path, root: Path | None) -> bool:
    """Whether `path`, a job's word, lies under MEDIC_ARTIFACT_ROOT (`root`): this service reads and
    writes the jobs' files there and nowhere else."""
    return root is not None and path.resolve().is_relative_to(root.resolve())


def write_asks(asks: list[ProfileAsk], root: Path | None) -> None:
    """Write each rank's profile request where its hooks look, only under `root` (MEDIC_ARTIFACT_ROOT,
    the directory jobs write their files to): the folder comes from the job's own reports, and this
    service writes nowhere an event names at will. One not under it, or that cannot be written, is
    logged and dropped: a profile is worth less than intake going on."""
    for ask in asks:
        if not under(ask.path, root):
            log.warning(
                "not asking %s rank %s for a profile: %s is not under MEDIC_ARTIFACT_ROOT (%s)",
                ask.job,
                ask.rank,
                ask.path.parent,
                root or "unset",
            )
            continue
        # Written aside and renamed in, as the hooks ask: a rank never reads half a request.
        aside = ask.path.with_name(ask.path.name + ".part")
        try:
            aside.write_text(ask.body())
            os.replace(aside, ask.path)
        except OSError as error:
            log.warning(
                "could not ask %s rank %s for a profile at %s: %s", ask.job, ask.rank, ask.path, error
            )
        else:
            log.info(
                "asked %s rank %s for %d steps from step %d", ask.job, ask.rank, ask.steps, ask.from_step
            )


def ask_and_diagnose(differential: Differential, root: Path | None) -> None:
    """Write the differential's profile requests and diff the pairs now in, here and now: what a
    file replayed in order needs (`medic demo`); the service diffs on a worker thread instead."""
    write_asks(differential.pairs.take_asks(), root)
    for traces in differential.pairs.take_ready():
        differential.pairs.diagnosed(traces, diff_pair(traces, root))


def diff_pair(traces: PairTraces, root: Path | None) -> ProfileDiff:
    """The diff of a pair's traces, read only under `root` (the paths are the job's reports); whatever
    goes wrong gives `unknown` with why, never a cause."""
    outside = [str(t) for t in (traces.suspect, traces.peer) if not under(t, root)]
    if outside:
        reason = f"not read: {', '.join(outside)} not under MEDIC_ARTIFACT_ROOT ({root or 'unset'})"
        return ProfileDiff(cause=Cause.UNKNOWN, confidence=0.0, reason=reason, steps=[])
    try:
        return diagnose(traces.suspect, traces.peer)
    except Exception as error:  # a bug in reading one odd trace must not end the service
        log.exception("the profile diff of %s and %s failed", traces.suspect, traces.peer)
        return ProfileDiff(cause=Cause.UNKNOWN, confidence=0.0, reason=f"the diff failed: {error}", steps=[])


def _run_flow(rt: Runtime, incident: Incident) -> None:
    asyncio.run(remediate_one(rt, incident))
