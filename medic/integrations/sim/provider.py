"""A `NodeProvider` over the simulated fleet: resets, reboots and replacements that take effect."""

from __future__ import annotations

from collections import deque
from datetime import UTC, datetime

from medic.integrations.settling import booted_since, not_booted
from medic.integrations.sim.fleet import SimFleet
from medic.protocols import NodeState, Settled


class SimProvider:
    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    def reset_gpu(self, node: str, gpu: int | None) -> str:
        with self.fleet.lock:
            self.fleet.record_call(node, "reset_gpu")
            self.fleet.node(node).gpu_resets += 1
        return f"reset GPU {gpu if gpu is not None else 'all'} on {node}"

    def reboot(self, node: str) -> str:
        with self.fleet.lock:
            self.fleet.record_call(node, "reboot")
            sim = self.fleet.node(node)
            sim.boots += 1
            sim.booted_at = datetime.now(UTC)
            sim.state = NodeState.REBOOTING
        return f"rebooted {node} (boot #{sim.boots})"

    def replace(self, node: str) -> str:
        with self.fleet.lock:
            self.fleet.record_call(node, "replace")
            sim = self.fleet.node(node)
            sim.replaced += 1
            sim.booted_at = datetime.now(UTC)
            sim.state = NodeState.REBOOTING
            # New hardware: whatever failures were scripted for the old one are gone.
            for key in [k for k in self.fleet.diagnostic_script if k[0] == node]:
                self.fleet.diagnostic_script[key] = deque()
            self.fleet.install_replacement(node)
        return f"replaced {node} with new hardware (replacement #{sim.replaced})"

    def booted_at(self, node: str) -> datetime | None:
        with self.fleet.lock:
            return self.fleet.node(node).booted_at

    def settle(self, node: str, action: str, since: datetime) -> Settled | None:
        """A simulated reboot or replacement boots the node at once, so an earlier boot means it never
        happened; a GPU reset leaves no boot to read."""
        booted = self.booted_at(node)
        if action == "reset_gpu" or booted is None:
            return None
        return booted_since(node, booted, since) or not_booted(node, booted)

    def wait_ready(self, node: str, timeout_s: float) -> bool:
        with self.fleet.lock:
            sim = self.fleet.node(node)
            if sim.state is NodeState.REBOOTING:
                # Back up, but still out of service until verification resumes it.
                sim.state = NodeState.DRAINED
            return sim.state is not NodeState.DOWN
