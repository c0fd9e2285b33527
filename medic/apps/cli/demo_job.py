"""The demo's training job, which answers GPU Medic's profile requests as a real job's hooks do.

`medic serve` asks a named straggler's rank and a healthy peer for a profile of the same steps by
writing request files where the ranks' step-timing reports say (medic/pair_profiles.py). The demo
plays the four ranks of its training job: each reports its step timings every `EVERY` steps (the
slow rank's own work 42% longer), looks for its request file with the hooks' own reader
(`ProfileTrigger`, medic/training/medic_hooks.py), and once the steps asked for have run, writes
its trace and reports it. The traces are not made up: real torch.profiler traces of the reference
job, the slow rank's with its matrix multiplies slowed as a degraded GPU slows its kernels
(medic/data/profiles/SOURCES.md). `through_differential` runs the demo's events through the intake
differential as `medic serve` does, the job's reports interleaved by time.
"""

from __future__ import annotations

import gzip
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from medic.culprit import Differential
from medic.events import EventKind, FaultEvent, event_time
from medic.profiles import PROFILE_CHECK
from medic.shipped import DEMO_PROFILES
from medic.training.medic_hooks import ProfileRequest, ProfileTrigger, Slowdown

EVERY = 10  # steps per step-timing report, as `train.py --timings-every=10`
POLL_S = 5.0  # how often a rank looks for its request file (the hooks' default)
SLOWER = 1.42  # the slow rank's own work against its peers'


@dataclass(slots=True)
class DemoJob:
    """The training job's ranks, one per node, from `first_step` at `start`, for `windows` reports."""

    name: str
    nodes: list[str]
    switches: dict[str, str | None]
    folder: Path  # where its ranks look for requests and write their traces (`artifacts_dir`)
    start: datetime
    first_step: int
    windows: int
    slow_rank: int
    gpu: int
    step_s: float = 2.3
    compute_s: float = 1.2
    emitted: list[FaultEvent] = field(default_factory=list)  # every report, for the demo's event file

    def reports(self) -> Iterator[FaultEvent]:
        """The ranks' reports in time order, produced lazily: a request written after one is read
        at the rank's next poll, as a running job would."""
        self.folder.mkdir(parents=True, exist_ok=True)
        clock = _Clock()
        triggers = [
            ProfileTrigger(self.folder, f"{self.name}-r{rank}", 3, math.inf, Slowdown(), POLL_S, clock)
            for rank in range(len(self.nodes))
        ]
        taking: dict[int, tuple[ProfileRequest, int]] = {}
        for offset in range(self.windows * EVERY):
            step = self.first_step + offset
            clock.now = offset * self.step_s
            for rank, trigger in enumerate(triggers):
                request = trigger.wanted(step)
                if request is not None:
                    taking[rank] = (request, step)
            ended = self.start + timedelta(seconds=(offset + 1) * self.step_s)
            for rank, (request, began) in sorted(taking.items()):
                if step - began + 1 == request.steps:
                    del taking[rank]
                    triggers[rank].taking = False  # as the hooks' `profiled` does: the next may come
                    yield self._profiled(rank, request, began, step, ended)
            if (offset + 1) % EVERY == 0:
                for rank in range(len(self.nodes)):
                    yield self._timings(rank, step + 1 - EVERY, ended)

    def _profiled(
        self, rank: int, request: ProfileRequest, first: int, last: int, at: datetime
    ) -> FaultEvent:
        role = "r1" if rank == self.slow_rank else "r0"  # the recorded slow rank, or a clean one
        recorded = DEMO_PROFILES / f"compute-{role}.pt.trace.json.gz"
        request.path.write_bytes(gzip.decompress(recorded.read_bytes()))
        attributes = {
            "check": PROFILE_CHECK,
            "artifact": str(request.path),
            "reason": request.reason,
            "first_step": first,
            "last_step": last,
        }
        return self._event(rank, at, f"profile-{first}", attributes, iteration=last)

    def _timings(self, rank: int, first: int, at: datetime) -> FaultEvent:
        work = self.compute_s * (SLOWER if rank == self.slow_rank else 1.0)
        attributes = {
            "check": "step_timings",
            "first_step": first,
            "world_size": len(self.nodes),
            "step_times_s": [self.step_s] * EVERY,
            # A little spread, as real steps have, the same from run to run.
            "compute_s": [round(work + 0.01 * ((step * (rank + 3)) % 5), 3) for step in range(EVERY)],
            "artifacts_dir": str(self.folder),
        }
        # The ranks of one round report a moment apart, in rank order.
        return self._event(rank, at + timedelta(seconds=rank / 10), f"timings-{first}", attributes)

    def _event(
        self, rank: int, at: datetime, what: str, attributes: dict[str, Any], iteration: int | None = None
    ) -> FaultEvent:
        node = self.nodes[rank]
        event = FaultEvent.model_validate(
            {
                "id": f"demo-{self.name}-r{rank}-{what}",
                "time": event_time(at),
                "source": "job",
                "kind": EventKind.HEALTH_CHECK,
                "node": node,
                "gpu": self.gpu,
                "job": self.name,
                "rank": rank,
                "iteration": iteration,
                "switch": self.switches.get(node),
                "attributes": attributes,
            }
        )
        self.emitted.append(event)
        return event


@dataclass(slots=True)
class _Clock:
    """The job's seconds since its first step: the triggers poll by it, not by the demo's wall clock."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def through_differential(events: list[FaultEvent], job: DemoJob, root: Path) -> list[FaultEvent]:
    """The events to correlate: `events` and the job's reports, merged by time, through the intake
    differential as `medic serve` passes them. Its profile requests are written under `root` as
    serve writes them; a pair once in is diffed at once, so the stragglers named after it carry
    the verdict."""
    from medic.flows.job_signals import ask_and_diagnose  # the flows' module: only when the demo runs

    differential = Differential(ask_profiles=True)
    scripted = deque(sorted(events, key=lambda e: e.time))
    out: list[FaultEvent] = []

    def push(event: FaultEvent) -> None:
        out.extend(differential.push(event))
        ask_and_diagnose(differential, root)

    for report in job.reports():
        while scripted and scripted[0].time <= report.time:
            push(scripted.popleft())
        push(report)
    for event in scripted:
        push(event)
    return out + differential.flush()
