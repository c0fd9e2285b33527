"""`HostEvidence` over the simulated fleet: what a node's `SimHardware` would leave in its kernel log
and `nvidia-smi -q`, marked as simulated. A node that is not in the fleet gives nothing."""

from __future__ import annotations

from datetime import UTC, datetime

from medic.integrations.sim.deep_checks import SIM_GPU
from medic.integrations.sim.fleet import SimFleet, SimHardware, UnknownSimNodeError
from medic.protocols import HostCapture, HostFile


def _kernel_log(hw: SimHardware) -> str:
    # The driver's own format (medic/integrations/kernel_log.py XID_LINE), on made-up bus ids.
    lines = [
        f"[    0.0] NVRM: Xid (PCI:0000:{index + 1:02x}:00): 79, pid='<unknown>', name=<unknown>, "
        "GPU has fallen off the bus."
        for index in hw.lost
    ]
    return "".join(f"{line}\n" for line in ["simulated kernel log", *lines])


def _nvidia_smi(hw: SimHardware) -> str:
    attached = hw.gpus - hw.missing
    gpus = "".join(
        f"\nGPU 00000000:{index + 1:02X}:00.0\n    Product Name : {SIM_GPU}\n" for index in range(attached)
    )
    return f"simulated nvidia-smi -q\nAttached GPUs : {attached}\n{gpus}"


class SimHostEvidence:
    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    def capture(self, node: str, timeout_s: float) -> HostCapture:
        started = datetime.now(UTC)
        with self.fleet.lock:
            if not self.fleet.has_node(node):
                why = str(UnknownSimNodeError(node, list(self.fleet.nodes)))
                return HostCapture(node, missing=(why,), started_at=started, finished_at=datetime.now(UTC))
            self.fleet.record_call(node, "host_evidence")
            hw = self.fleet.hardware_of(node)
        files = (
            HostFile("kernel-log.txt", "kernel log (NVRM, Xid, GPU lines)", _kernel_log(hw).encode()),
            HostFile("nvidia-smi-q.txt", "nvidia-smi -q", _nvidia_smi(hw).encode()),
        )
        missing = (f"nvidia-bug-report.sh: not installed on {node} (simulated)",)
        return HostCapture(node, files, missing, started, datetime.now(UTC))
