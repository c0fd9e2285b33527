"""What the simulated fleet is made of and how long each thing takes (docs/simulate.md#parameters).

The defaults describe the Llama 3 405B pre-training cluster (Meta, "The Llama 3 Herd of Models",
2024, section 3.3.4): 16,384 H100s in 8-GPU servers, 419 unexpected interruptions in 54 days,
which is one failure per GPU every 54 * 24 * 16,384 / 419 ≈ 50,700 hours. The defaults' durations
are assumptions of what a fleet remediated by GPU Medic takes; `measured` puts in those the
end-to-end recovery benchmark measured on a real Slurm cluster, `meta_like_recovery` is the slower
recovery a team without GPU Medic sees, and `fast_checkpointer` a job that saves to and restores
from host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from medic import advise
from medic.whatif.fleetsim.measurement import Measurement, RecoveryPath, shipped

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54.0
LLAMA3_INTERRUPTIONS = 419
LLAMA3_GPU_MTBF_HOURS = LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS

# DCGM diagnostic levels, (shortest, longest) run in seconds (docs/dcgm.md).
DCGM_LEVEL_SECONDS: dict[int, tuple[float, float]] = {
    1: (0.5, 2.5),
    2: (150.0, 630.0),
    3: (600.0, 2100.0),
    4: (1800.0, 7200.0),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SimParams:
    gpus: int = LLAMA3_GPUS
    days: float = LLAMA3_DAYS
    gpus_per_node: int = 8
    nodes_per_switch: int = 16
    gpu_mtbf_hours: float = LLAMA3_GPU_MTBF_HOURS
    spare_nodes: int = 32  # idle nodes the job can restart on while a node is repaired
    checkpoint_save_s: float = 2.5  # training blocked per save
    checkpoint_interval_s: float | None = None  # None: Young's optimum for the job's MTBF
    # Fault to event received, by how the fault shows itself.
    detect_kernel_s: float = 5.0  # an XID in the kernel log, read by the node agent
    detect_health_s: float = 30.0  # a DCGM health watch or NVML poll, a node that stops answering
    detect_crash_s: float = 15.0  # a rank exits; the job's hook or the scheduler reports it
    detect_hang_s: float = 600.0  # a collective hangs until the NCCL watchdog fires (PyTorch's default)
    restart_s: float = 300.0  # requeue on healthy nodes, load the checkpoint, first step done
    restart_in_place_s: float | None = None  # the node stayed: restart on the same nodes; None: restart_s
    # A hang, the node in service: GPU Medic requeues the job onto its nodes; None: as any restart in place
    # (the watchdog ends the hang, torchrun restarts the group).
    restart_hung_s: float | None = None
    reset_gpu_s: float = 120.0
    reboot_s: float = 900.0
    replace_s: float = 4 * 3600.0  # the provider hands back a new node
    network_repair_s: float = 2 * 3600.0  # a switch or cable fixed by the network team
    human_response_s: float = 1800.0  # on-call answers an escalation (or an approval)
    recurrence_hours: float = 6.0  # a fault left in place strikes again, on average, this much later
    repeats_before_human: int = 2  # a node failing this often again with one fault gets a person's look
    dcgm_level_s: dict[int, tuple[float, float]] = field(default_factory=lambda: dict(DCGM_LEVEL_SECONDS))

    def __post_init__(self) -> None:
        if self.gpus < self.gpus_per_node or self.gpus_per_node < 1:
            raise ValueError(f"gpus ({self.gpus}) must be at least gpus_per_node ({self.gpus_per_node})")
        for name in ("days", "gpu_mtbf_hours", "checkpoint_save_s", "recurrence_hours"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, not {value}")
        if self.spare_nodes < 0 or self.repeats_before_human < 1:
            raise ValueError("spare_nodes must be >= 0 and repeats_before_human >= 1")

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def horizon_s(self) -> float:
        return self.days * 86_400

    @property
    def job_mtbf_s(self) -> float:
        return advise.job_mtbf_hours(self.gpu_mtbf_hours, self.gpus) * advise.SECONDS_PER_HOUR

    @property
    def in_place_restart_s(self) -> float:
        """The job's restart when the node stays in service."""
        return self.restart_s if self.restart_in_place_s is None else self.restart_in_place_s

    @property
    def hung_restart_s(self) -> float:
        """The job's restart after a hang, when the node stays in service."""
        return self.in_place_restart_s if self.restart_hung_s is None else self.restart_hung_s

    @property
    def interval_s(self) -> float:
        """Training time between two saves."""
        if self.checkpoint_interval_s is not None:
            return self.checkpoint_interval_s
        return advise.optimal_interval(self.checkpoint_save_s, self.job_mtbf_s)


def fast_checkpointer(params: SimParams) -> SimParams:
    """Checkpoints snapshotted to host memory and restored from it: a save blocks training a quarter
    of a second, a restart takes a minute."""
    return replace(params, checkpoint_save_s=0.25, restart_s=60.0)


def meta_like_recovery(params: SimParams) -> SimParams:
    """Slower recovery, as a team with its own tooling runs a 16k-GPU job: faults found within a
    minute (or by the hang they cause), eight minutes to restart the job, an hour for a person to
    answer, and a person looking at any node that fails twice."""
    return replace(
        params,
        detect_kernel_s=60.0,
        detect_health_s=60.0,
        detect_crash_s=60.0,
        restart_s=480.0,
        human_response_s=3600.0,
        repeats_before_human=1,
    )


def measured(params: SimParams, measurement: Measurement | None = None) -> SimParams:
    """Durations measured end to end on a real Slurm cluster (medic/data/recovery-measured.json, or
    `measurement`), each the median from the incident opened to the job's first step back; the
    simulator charges detection by itself. A restart with the node in service is the in-place path's
    (torchrun restarts the group, no requeue); a requeue onto a spare or an idle node is the spare
    path's. Medians rather than p95s: a run adds one restart per interruption, hundreds of them, so the typical
    figure is the one their sum wants (docs/simulate.md#the-measured-profile).

    The hangs simulated (a switch, a cable, a NIC, a collective's timeout) leave every rank waiting
    inside the same collective: the hang path's detection (the ranks' stall watch at its default,
    the job named hung from their reports) replaces the watchdog's 10 minutes in `detect_hang_s`,
    and its restart (the job requeued onto its own nodes) is `restart_hung_s`.

    A real server's GPU reset, reboot and replacement stay the assumed `reset_gpu_s`, `reboot_s` and
    `replace_s`: the cluster measured has no GPU to reset and reboots a stand-in in about a second.
    """
    found = shipped() if measurement is None else measurement
    return replace(
        params,
        detect_hang_s=found.detection_s(RecoveryPath.HANG),
        restart_in_place_s=found.after_detection_s(RecoveryPath.IN_PLACE),
        restart_hung_s=found.after_detection_s(RecoveryPath.HANG),
        restart_s=found.after_detection_s(RecoveryPath.SPARE),
    )
