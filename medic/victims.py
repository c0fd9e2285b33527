"""Crashes caused by a peer's loss: evidence for the peer's fault, not a fault of their own node.

When a rank dies (its GPU fell off the bus, it was killed, its process crashed), the ranks waiting on it
in a collective fail too. With gloo the survivor's collective raises "Connection closed by peer" as soon
as the dead rank's sockets close, and the survivor's hooks report a `job_crash` about a node that did
nothing wrong. Each such crash would open an incident (an application fault) on a healthy node.

So a `job_crash` whose message says its peer went away is held for `settle` (the other ranks' own
reports, the node agent's XIDs, arrive within seconds). It is a **victim** when some other node of
its job (known from the ranks' earlier reports) has a fault of its own within `settle` of it: then it
is kept as evidence and opens nothing. It is stored like every event, and paired with that fault in
`explained`, for the store to mark it explained: a start hands on no explained event again. When
nothing else explains it (the peer's node went silent, or no other rank of the job is known), it
goes on as it came: a state we cannot explain is never taken for a healthy node.

The phrases are gloo's, recorded from a real run (tests/fixtures/hangs/README.md). NCCL reports a
lost peer as a collective timeout or an aborted communicator, which the hang attribution reads.
Pure: events in, events out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from medic.events import EventKind, FaultEvent
from medic.peers import Member

# gloo's transport when the other end of a pair closes: third_party/gloo/gloo/transport/tcp/pair.cc.
PEER_LOSS = ("Connection closed by peer", "Connection reset by peer")
SETTLE = timedelta(seconds=30)  # as a collective timeout's: the peer's own reports come within it
RECENT = 4096  # faults remembered to explain a victim: a fleet's burst, bounded whatever its size


def is_peer_loss(event: FaultEvent) -> bool:
    message = event.attributes.get("message")
    return (
        event.kind is EventKind.JOB_CRASH
        and event.job is not None
        and event.rank is not None
        and isinstance(message, str)
        and any(phrase in message for phrase in PEER_LOSS)
    )


@dataclass(slots=True)
class Victims:
    """Holds the crashes a peer's loss caused until each is explained by another node's fault, or not."""

    members: Mapping[tuple[str, int], Member]
    settle: timedelta = SETTLE
    held: list[FaultEvent] = field(default_factory=list)
    # (time, node, id) of every other fault that came through: what may explain a victim.
    faults: deque[tuple[datetime, str, str]] = field(default_factory=lambda: deque(maxlen=RECENT))
    # (victim's id, the id of the fault that explains it), since the caller last took them.
    explained: list[tuple[str, str]] = field(default_factory=list)

    def hold(self, event: FaultEvent) -> None:
        self.held.append(event)

    def saw(self, event: FaultEvent) -> None:
        """A fault that went on to correlation: it may be the peer's own."""
        self.faults.append((event.time, event.node, event.id))

    def due(self, now: datetime) -> list[FaultEvent]:
        """The victims whose settling time has passed by `now` that nothing explained."""
        settled = [e for e in self.held if now >= e.time + self.settle]
        self.held = [e for e in self.held if now < e.time + self.settle]
        return self._unexplained(settled)

    def flush(self) -> list[FaultEvent]:
        held, self.held = self.held, []
        return self._unexplained(held)

    def next_due(self) -> datetime | None:
        return min((e.time + self.settle for e in self.held), default=None)

    def _unexplained(self, settled: list[FaultEvent]) -> list[FaultEvent]:
        out = []
        for victim in settled:
            by = self._explainer(victim)
            if by is None:
                out.append(victim)
            else:
                self.explained.append((victim.id, by))
        return out

    def _explainer(self, victim: FaultEvent) -> str | None:
        peers = {m.node for (job, _), m in self.members.items() if job == victim.job} - {victim.node}
        return next(
            (i for at, node, i in self.faults if node in peers and abs(at - victim.time) <= self.settle), None
        )
