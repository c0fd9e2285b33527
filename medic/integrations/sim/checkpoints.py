"""`CheckpointStore` over the simulated fleet's jobs."""

from __future__ import annotations

from medic.integrations.sim.fleet import SimFleet
from medic.protocols import Checkpoint


class SimCheckpoints:
    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    def latest(self, job: str) -> Checkpoint | None:
        with self.fleet.lock:
            sim = self.fleet.jobs.get(job)
            if sim is None or sim.last_checkpoint is None:
                return None
            step, saved_at = sim.last_checkpoint
            return Checkpoint(job, step, saved_at, f"sim://{job}/step-{step:08d}")
