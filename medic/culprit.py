"""Differential diagnosis at intake: find the culprit, not the victim (docs/culprit.md).

Between validation and correlation, events pass through here:
- step-timings reports feed the peer detector (medic/peers.py) and go no further: telemetry is
  no fault, and a report per rank per window must not open an incident per node;
- collective timeouts that say where their rank was are held for the hang attributor
  (medic/hangs.py) and come out as their culprit's event, or as they came when no rank stands out;
  a rank's own stall report is kept as evidence for it (its stack dump, where it stopped);
- a rank's own profile report is kept for the stragglers named about it (medic/profiles.py);
- where asked to (`medic serve`), a named straggler's rank and a healthy peer are asked for a profile
  of the same steps, and the diff of the two, once the caller has run it, goes on the stragglers
  about that rank (medic/pair_profiles.py), which wait for it (at most VERDICT_WAIT);
- a crash a peer's loss caused (gloo's "Connection closed by peer") is held until another node of its
  job is seen failing, and then opens nothing: it is the victim, not the fault (medic/victims.py);
- every event, derived ones too, gets its node's leaf switch from the topology where it names none.

Pure and deterministic: the same events give the same events out, with the same ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from medic.events import FaultEvent
from medic.hangs import SETTLE, STALL_CHECK, HangAttributor
from medic.pair_profiles import PairProfiles
from medic.peers import TIMINGS_CHECK, Member, PeerDetector, Thresholds, timings_of
from medic.profiles import PROFILE_CHECK, Profiles, is_profile
from medic.topology import Topology
from medic.victims import Victims, is_peer_loss

# The `health_check` reports read here and never handed on: a job's live signals, sent again every
# window (step timings), every stall-watch period (stalls) or when asked (profiles). Stored as they
# came, they are in no incident; one read back after a restart is stale, and a job reporting for a
# day leaves millions of them (Store.undispatched_events leaves them out).
LIVE_REPORTS = frozenset({TIMINGS_CHECK, STALL_CHECK, PROFILE_CHECK})


class Differential:
    def __init__(
        self,
        topology: Topology | None = None,
        thresholds: Thresholds | None = None,
        settle: timedelta = SETTLE,
        *,
        ask_profiles: bool = False,
    ) -> None:
        self.topology = topology or Topology()
        self.peers = PeerDetector(thresholds)
        # Ranks' places, from any event that names job and rank: what names a culprit that never reported.
        self.members: dict[tuple[str, int], Member] = self.peers.members
        self.hangs = HangAttributor(self.members, settle)
        self.victims = Victims(self.members, settle)
        self.profiles = Profiles()
        self.pairs = PairProfiles(self.members, asking=ask_profiles)

    def push(self, event: FaultEvent) -> list[FaultEvent]:
        """The events to correlate now that `event` came (time order is the caller's)."""
        event = self.topology.place(event)
        out = self.hangs.due(event.time)
        if event.job is not None and event.rank is not None:
            self.members[event.job, event.rank] = Member(event.node, event.gpu, event.switch)
        if (timings := timings_of(event)) is not None:
            if event.job is not None:
                self.hangs.progressed(event.job)
            self.pairs.report(event, timings)
            named = self.peers.push(event)
            self.pairs.ask(named)
            out += named
        elif self.hangs.is_stall(event):
            self.hangs.stalled(event)
        elif is_profile(event):
            self.profiles.keep(event)
            self.pairs.profiled(event)
        elif is_peer_loss(event):
            self.victims.hold(event)
        elif self.hangs.takes(event):
            self.hangs.push(event)
        else:
            out.append(event)
        out = [e for e in self._seen(out) + self.victims.due(event.time) if not self.pairs.hold(e)]
        return [self._carried(e) for e in out + self.pairs.due(event.time)]

    def due(self, now: datetime) -> list[FaultEvent]:
        """Held reports whose settling time has passed by `now` (a live service's timer)."""
        held = self._seen(self.hangs.due(now)) + self.victims.due(now) + self.pairs.due(now)
        return [self._carried(e) for e in held]

    def flush(self) -> list[FaultEvent]:
        """Everything still held: the end of a file."""
        held = self._seen(self.hangs.flush()) + self.victims.flush() + self.pairs.flush()
        return [self._carried(e) for e in held]

    def take_explained(self) -> list[tuple[str, str]]:
        """The events absorbed as another's evidence since the last call, each as (its id, the id of
        the event that explains it): a victim's crash and its peer's fault, a hang's timeouts and
        their culprit. No incident holds them; the caller marks them (`Store.mark_explained`)."""
        taken = self.victims.explained + self.hangs.explained
        self.victims.explained, self.hangs.explained = [], []
        return taken

    def next_due(self) -> datetime | None:
        """When the next held report settles, if any is held."""
        due = (self.hangs.next_due(), self.victims.next_due(), self.pairs.next_due())
        return min(filter(None, due), default=None)

    def _carried(self, event: FaultEvent) -> FaultEvent:
        """An event as it goes on: a straggler with its rank's profile and its pair's verdict, placed."""
        return self.topology.place(self.pairs.attach(self.profiles.attach(event)))

    def _seen(self, out: list[FaultEvent]) -> list[FaultEvent]:
        """Faults going on to correlation: each may explain a victim of its node's loss."""
        for event in out:
            self.victims.saw(event)
        return out


def differential(events: Iterable[FaultEvent], topology: Topology | None = None) -> list[FaultEvent]:
    """A finite input through the differential, in the order given: an input without step timings or
    timeout positions comes out as it went in."""
    diff = Differential(topology)
    return [found for event in events for found in diff.push(event)] + diff.flush()
