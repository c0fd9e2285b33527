"""`GpuReset` over the simulated fleet: a reset that takes effect at once, unless the fleet scripts a
refusal for the node (`SimFleet.reset_refusals`: a process still on the GPU, say)."""

from __future__ import annotations

from medic.integrations.sim.fleet import SimFleet
from medic.integrations.sim.provider import SimProvider
from medic.protocols import GpuResetOutcome


class SimGpuReset:
    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    def reset(self, node: str, gpu: int | None) -> GpuResetOutcome:
        which = "all GPUs" if gpu is None else f"GPU {gpu}"
        with self.fleet.lock:
            if not self.fleet.has_node(node):
                return GpuResetOutcome(False, f"not reset: {node} is not in the simulated fleet")
            sim = self.fleet.node(node)
            gpus = tuple(range(sim.gpus)) if gpu is None else (gpu,)
            refusal = self.fleet.reset_refusals.get(node)
            if refusal:
                return GpuResetOutcome(False, f"{which} not reset: {refusal}", gpus)
            # The simulated provider's reset_gpu already resets in place: the same effect, said the same way.
            done = SimProvider(self.fleet).reset_gpu(node, gpu)
        return GpuResetOutcome(True, done, gpus)
