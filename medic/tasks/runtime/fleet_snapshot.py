"""The fleet's nodes as the scheduler lists them, read once for the decisions of a few seconds.

Every decision reads the whole fleet: its size and the nodes out of service (the guardrails), its
switches (storms), the groups' members. At 10,000 nodes one read is a 12 MB `sinfo --json` on Slurm
22.05 (about 1.1 s with its parsing) and 33 ms of the simulated scheduler, and each decision made
one per fault besides the last check's under the guardrail slot (BENCHMARKS.md, "At fleet scale").
A snapshot now serves every decision of a process for `SNAPSHOT_S`.

What a snapshot can miss is bounded (decision 0023): the nodes GPU Medic took out after it was read
are added from the store, which every replica writes its drains to, so a decision counts every node
of ours as a fresh read would; a node someone else took out in those seconds is seen by the last
check under the slot, which still reads the scheduler itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from medic.protocols import NodeInfo
from medic.store import utcnow

SNAPSHOT_S = 5.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    nodes: list[NodeInfo]
    read_at: datetime  # when the read began: the drains recorded from then on are added to it


class FleetNodes:
    """The latest snapshot of the scheduler's node list, read again once it is `max_age_s` old.
    Thread-safe, and one read at a time: decisions that need the fleet together share one read."""

    def __init__(
        self,
        read: Callable[[], list[NodeInfo]],
        max_age_s: float = SNAPSHOT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read, self._max_age_s, self._clock = read, max_age_s, clock
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._taken = 0.0

    def get(self) -> Snapshot:
        with self._lock:
            if self._snapshot is None or self._clock() - self._taken >= self._max_age_s:
                taken, read_at = self._clock(), utcnow()
                self._snapshot = Snapshot(self._read(), read_at)
                self._taken = taken
            return self._snapshot
