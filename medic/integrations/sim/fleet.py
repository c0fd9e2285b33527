"""One in-process simulated fleet: nodes, GPUs, training jobs, faults and scripted diagnostics.

Every simulated backend (scheduler, provider, diagnostics, checkpoints) reads and changes this
one object, so an action taken through one Protocol is seen through the others, as on a real
cluster. Time in the simulation is real time; a running job advances one step each time its
state is read, which keeps "wait for the job to pass its checkpoint" fast and deterministic.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from medic.errors import PermanentError, TransientError
from medic.protocols import JobState, NodeState


class SimTransientFailure(TransientError):
    """Raised when a call scripted by `fail_next` fails the way a throttled or unreachable API does."""


class SimPermanentFailure(PermanentError):
    """Raised when a call scripted by `fail_next(..., permanent=True)` is refused for good."""


class UnknownSimNodeError(PermanentError, LookupError):
    """Raised when a node name is not in the simulated fleet: the simulation never stands in for a
    real host (it would "pass" its diagnostics and put it back in service)."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.node = name
        known = sorted(known, key=_natural)
        shown = ", ".join(known[:4]) + (f", ... ({len(known)} nodes)" if len(known) > 4 else "")
        super().__init__(
            f"{name} is not in the simulated fleet ({shown or 'no nodes'}): configure the real backends "
            "(docs/config.md) to act on real nodes"
        )


def _natural(name: str) -> tuple[str, int]:
    """gpu-node-2 before gpu-node-10."""
    stem = name.rstrip("0123456789")
    digits = name[len(stem) :]
    return stem, int(digits) if digits else -1


@dataclass(slots=True)
class SimNode:
    name: str
    switch: str
    gpus: int
    state: NodeState = NodeState.IDLE
    reason: str | None = None
    boots: int = 0
    booted_at: datetime | None = None
    replaced: int = 0
    gpu_resets: int = 0
    # What a node group selects on; None plays a scheduler that does not say (decision 0017).
    partitions: tuple[str, ...] | None = ("gpu",)
    features: tuple[str, ...] | None = ()
    gpu_model: str | None = "h100"


@dataclass(frozen=True, slots=True)
class SimHardware:
    """What a node's GPUs and links show the deep checks (NVML, an all-reduce, a NIC loopback)."""

    gpus: int
    nvlinks: int = 18  # per GPU: an H100 SXM's
    missing: int = 0  # GPUs the driver does not enumerate (the last ones)
    lost: tuple[int, ...] = ()  # enumerated GPUs that do not answer
    links_down: tuple[tuple[int, int], ...] = ()  # (GPU, link)
    busbw_gbps: float = 480.0  # all-reduce bus bandwidth across the node's own GPUs
    fabric_busbw_gbps: float = 360.0  # ... across nodes: what the network gives each
    wrong_results: bool = False  # an all-reduce on it computes wrong sums
    nic_gbps: float = 390.0  # ib_write_bw loopback on each RDMA device: a 400 Gb/s NIC's
    nic_lat_us: float = 1.5  # ib_write_lat's t_typical in loopback, 2-byte writes


@dataclass(slots=True)
class SimJob:
    id: str
    owner: str
    nodes: list[str]
    step: int = 0
    state: JobState = JobState.RUNNING
    checkpoint_every: int = 100
    step_seconds: float = 2.0
    restarts: int = 0
    last_checkpoint: tuple[int, datetime] | None = None


@dataclass(slots=True)
class SimFleet:
    nodes: dict[str, SimNode] = field(default_factory=dict)
    jobs: dict[str, SimJob] = field(default_factory=dict)
    # (node, level) -> queued (result, error ids); an empty queue means the level passes.
    diagnostic_script: dict[tuple[str, int], deque[tuple[str, tuple[str, ...]]]] = field(
        default_factory=lambda: defaultdict(deque)
    )
    # (node, action) -> how many more calls should fail, to exercise retries.
    failures: dict[tuple[str, str], int] = field(default_factory=dict)
    permanent_failures: set[tuple[str, str]] = field(default_factory=set)  # fail as refused, not transient
    calls: list[tuple[str, str]] = field(default_factory=list)
    # node -> its hardware when scripted (healthy otherwise), and what its next replacement brings.
    hardware: dict[str, SimHardware] = field(default_factory=dict)
    replacements: dict[str, SimHardware] = field(default_factory=dict)
    reservations: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a sweep's: name -> nodes
    reset_refusals: dict[str, str] = field(default_factory=dict)  # node -> why its GPU reset is refused
    lock: threading.RLock = field(default_factory=threading.RLock)

    @classmethod
    def build(cls, nodes: int = 8, gpus: int = 8, per_switch: int = 4, prefix: str = "gpu-node-") -> SimFleet:
        fleet = cls()
        for i in range(1, nodes + 1):
            name = f"{prefix}{i}"
            fleet.nodes[name] = SimNode(name, switch=f"leaf-{(i - 1) // per_switch + 1}", gpus=gpus)
        return fleet

    def node(self, name: str) -> SimNode:
        """A node by name; `UnknownSimNodeError` for a name the fleet does not have."""
        with self.lock:
            if name not in self.nodes:
                raise UnknownSimNodeError(name, list(self.nodes))
            return self.nodes[name]

    def has_node(self, name: str) -> bool:
        with self.lock:
            return name in self.nodes

    def add_job(
        self,
        job_id: str,
        owner: str,
        nodes: list[str],
        *,
        step: int = 0,
        checkpoint_every: int = 100,
        step_seconds: float = 2.0,
    ) -> SimJob:
        with self.lock:
            job = SimJob(job_id, owner, list(nodes), step, JobState.RUNNING, checkpoint_every, step_seconds)
            self._checkpoint(job)
            self.jobs[job_id] = job
            for name in nodes:
                self.node(name).state = NodeState.ALLOCATED
            return job

    def _checkpoint(self, job: SimJob) -> None:
        saved_step = job.step - job.step % job.checkpoint_every
        age = timedelta(seconds=(job.step - saved_step) * job.step_seconds)
        job.last_checkpoint = (saved_step, datetime.now(UTC) - age)

    def crash_job(self, job_id: str) -> SimJob:
        """A fault killed the job: it stops where it was; its nodes keep their state."""
        with self.lock:
            job = self.jobs[job_id]
            job.state = JobState.FAILED
            return job

    def advance(self, job: SimJob) -> None:
        if job.state is JobState.RUNNING:
            job.step += 1
            if job.step % job.checkpoint_every == 0:
                self._checkpoint(job)

    def script_diagnostic(self, node: str, level: int, result: str, error_ids: tuple[str, ...] = ()) -> None:
        with self.lock:
            self.diagnostic_script[(node, level)].append((result, error_ids))

    def hardware_of(self, node: str) -> SimHardware:
        with self.lock:
            return self.hardware.get(node) or SimHardware(self.node(node).gpus)

    def script_hardware(self, node: str, **changes: Any) -> None:
        """Change what the node's hardware shows from now on (a GPU lost, a link down, slow links)."""
        with self.lock:
            self.hardware[node] = replace(self.hardware_of(node), **changes)

    def script_replacement(self, node: str, **changes: Any) -> None:
        """What the node's next replacement brings: healthy hardware unless changed here."""
        with self.lock:
            self.replacements[node] = replace(SimHardware(self.node(node).gpus), **changes)

    def install_replacement(self, node: str) -> None:
        with self.lock:
            scripted = self.replacements.pop(node, None)
            self.hardware[node] = scripted or SimHardware(self.node(node).gpus)

    def fail_next(self, node: str, action: str, times: int = 1, *, permanent: bool = False) -> None:
        """The next `times` calls fail: transiently (the task layer retries them), or as refused."""
        with self.lock:
            self.failures[(node, action)] = times
            if permanent:
                self.permanent_failures.add((node, action))
            else:
                self.permanent_failures.discard((node, action))

    def record_call(self, node: str, action: str) -> None:
        """Count a backend call; raise if a failure was scripted for it."""
        with self.lock:
            self.calls.append((node, action))
            left = self.failures.get((node, action), 0)
            if left > 0:
                self.failures[(node, action)] = left - 1
                if (node, action) in self.permanent_failures:
                    raise SimPermanentFailure(f"simulated {action} refusal on {node}")
                raise SimTransientFailure(f"simulated {action} failure on {node}")
