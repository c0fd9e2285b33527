"""A job's own signals on the warm path: the differential (medic/culprit.py) over the events `medic serve`
stored. Step timings become the stragglers their peers reveal, a hang's timeouts become its culprit's
(held `settle` seconds for the reports to come in), and events without a switch get their node's leaf
from the scheduler. What it derives is stored before it is correlated, like every event. When it names
a straggler, the rank and a healthy peer are asked for a profile of the same steps (a request file
each, written here), and once both are reported their diff (medic/profile_diff.py) runs on a worker
thread; the stragglers about that rank carry its verdict from then on (docs/culprit.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from medic.culprit import Differential
from medic.events import FaultEvent
from medic.pair_profiles import PairTraces, ProfileAsk
from medic.profile_diff import Cause, ProfileDiff, diagnose
from medic.tasks.runtime.process import Runtime
from medic.topology import Topology

log = logging.getLogger("medic.live")
TOPOLOGY_REFRESH_S = 600.0  # switches change with recabling, not by the minute


class JobSignals:
    """The differential of one process, fed from the event loop's worker threads: batches and the
    settle timer take turns on it; a pair's diff runs beside them."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.differential = Differential(ask_profiles=True)
        self._turns = threading.Lock()
        self._topology_until = 0.0
        self._never_complete: set[str] = set()  # jobs warned about (_warn_never_complete)

    def sift(self, events: list[FaultEvent]) -> tuple[list[FaultEvent], list[PairTraces]]:
        """The events to correlate, and the pairs of profiles now ready to diff."""
        with self._turns:
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

    def next_due(self) -> datetime | None:
        """When the next held report settles."""
        return self.differential.next_due()

    def settled(self) -> list[FaultEvent]:
        """What settled by now, stored."""
        with self._turns:
            return self._stored([], self.differential.due(datetime.now(UTC)))

    def diff(self, traces: PairTraces) -> list[FaultEvent]:
        """Diff a pair's traces (seconds of CPU, outside the lock: intake goes on meanwhile); the
        stragglers that waited for its verdict, stored, to correlate now."""
        diff = diff_pair(traces, self.rt.artifact_root)
        log.info(
            "profile diff of %s rank %s: %s (%s)", traces.job, traces.suspect_rank, diff.cause, diff.reason
        )
        with self._turns:
            self.differential.pairs.diagnosed(traces, diff)
            return self._stored([], self.differential.due(datetime.now(UTC)))

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

    def _stored(self, given: list[FaultEvent], out: list[FaultEvent]) -> list[FaultEvent]:
        given_ids = {e.id for e in given}
        self.rt.store.record_accepted(e for e in out if e.id not in given_ids)  # derived: a culprit
        # What the differential absorbed as evidence is in no incident: marked, a start does not hand
        # it on again (the culprit it was absorbed into is stored above, before it is named).
        self.rt.store.mark_explained(self.differential.take_explained())
        return out


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
