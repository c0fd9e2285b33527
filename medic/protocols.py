"""The small interfaces flows talk to. Each has a simulated implementation (medic/integrations/sim)
used by the demo and tests; real ones (Slurm, HyperPod, EC2, DCGM, Slack, DCP) plug in by
configuration without the flows changing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Protocol, runtime_checkable

from medic.artifacts import Artifact
from medic.events import FaultEvent


class NodeState(StrEnum):
    IDLE = "idle"
    ALLOCATED = "allocated"
    DRAINED = "drained"  # no new work; running work may finish
    DOWN = "down"
    REBOOTING = "rebooting"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    state: NodeState
    reason: str | None = None  # why it is drained/down, as the scheduler shows it
    switch: str | None = None
    gpus: int = 0
    # What a policy's node groups select on (docs/policy.md#groups); None: the scheduler does not say,
    # which a group that needs it must never take for "none".
    partitions: tuple[str, ...] | None = None
    features: tuple[str, ...] | None = None
    gpu_model: str | None = None

    @property
    def drained_by_medic(self) -> bool:
        return self.state in (NodeState.DRAINED, NodeState.DOWN) and (self.reason or "").startswith("medic:")

    @property
    def out_of_service(self) -> bool:
        """Drained, down or rebooting: the scheduler gives it no new work, whoever took it out."""
        return self.state in (NodeState.DRAINED, NodeState.DOWN, NodeState.REBOOTING)


class JobState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    FAILED = "failed"
    COMPLETED = "completed"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class JobInfo:
    id: str
    state: JobState
    nodes: tuple[str, ...]
    owner: str | None = None
    step: int | None = None  # the last training step the job reported
    restarts: int = 0


class NodeChangeWatch(Protocol):
    """What people did to nodes since the last poll, as `node_state` events (decision 0019): the
    scheduler's own record compared with the last one read, GPU Medic's own changes left out. The
    first poll is the baseline and says nothing."""

    def poll(self) -> list[FaultEvent]: ...


@runtime_checkable
class Scheduler(Protocol):
    def nodes(self) -> list[NodeInfo]: ...
    def node(self, name: str) -> NodeInfo: ...
    def job(self, job_id: str) -> JobInfo | None: ...
    def jobs_on_node(self, name: str) -> list[JobInfo]: ...
    def drain(self, name: str, reason: str) -> None: ...
    def resume(self, name: str) -> None: ...
    def requeue(self, job_id: str, exclude: list[str]) -> JobInfo: ...
    def readmit(self, job_id: str, node: str) -> bool:
        """Lift `requeue`'s bar on `node`, once the node is repaired, for a job that waits because no
        node it may use is free: with no spare and no idle node, the repaired node is the one it waits
        for. True when a bar was lifted; False when the job runs, waits for anything else, or was never
        barred from the node."""
        ...


@runtime_checkable
class Reservations(Protocol):
    """Schedulers that can hold idle nodes for a while, so that no job lands on them during a sweep's
    deep check (docs/sweeps.md). Apart from `Scheduler`: one without reservations is never swept.

    `reserve` holds every node or none, for `minutes`, and returns the reservation's name; a node that
    took a job meanwhile is refused with `medic.sweep.NodeBusyError`. `release` ends a reservation
    (one already gone is no error). `reserved_nodes` lists the nodes our sweeps hold now: they count
    as out of service for the guardrails."""

    def reserve(self, nodes: Sequence[str], minutes: int, reason: str) -> str: ...
    def release(self, name: str) -> None: ...
    def reserved_nodes(self) -> frozenset[str]: ...


# The reservation that holds the spare pool, on schedulers that hold it with one (Slurm).
SPARES_RESERVATION = "medic-spares"


@runtime_checkable
class SparePool(Protocol):
    """Schedulers that can hold idle nodes back as spares (docs/spares.md), so that a job requeued off a
    node that must go starts again at once instead of waiting for the repair. Apart from `Scheduler`:
    one without a pool has no spares.

    `spare_nodes` lists the pool. `lend` hands one spare to general service, where the requeued job
    lands, and returns its name (None: the pool is empty). `refill` puts a node in the pool: no job
    lands on it there. Neither touches a node's drain: the caller resumes a repaired node."""

    def spare_nodes(self) -> frozenset[str]: ...
    def lend(self) -> str | None: ...
    def refill(self, node: str) -> None: ...


@runtime_checkable
class NodeProvider(Protocol):
    """Hardware actions. Each returns a short description of what the backend did."""

    def reset_gpu(self, node: str, gpu: int | None) -> str: ...
    def reboot(self, node: str) -> str: ...
    def replace(self, node: str) -> str: ...
    def wait_ready(self, node: str, timeout_s: float) -> bool:
        """After a reboot or replacement this provider requested: True only once the node was seen to go
        away and come back healthy (a later boot time, a new instance or launch time, a status that left
        and returned), never merely because it still looks up; False when it is gone for good (failed,
        terminated with nothing replacing it); a PermanentError (the real providers' NodeNotBackError) when
        that was not seen within `timeout_s`: the outcome is unconfirmed and must escalate, node held."""
        ...


@dataclass(frozen=True, slots=True)
class GpuResetOutcome:
    """What a GPU reset did. `done` only when the reset was confirmed (the tool said so for every GPU
    it was asked to reset, and they answer again); anything else is not done, and `detail` says why:
    the act stage then reboots the node instead and says so."""

    done: bool
    detail: str
    gpus: tuple[int, ...] = ()  # the GPUs the reset was asked for (all of the node's where that was needed)


@runtime_checkable
class GpuReset(Protocol):
    """Resetting a node's GPU in place, on a node already drained with its jobs off: a reset takes
    seconds where a reboot takes minutes (docs/gpu-reset.md). `gpu` None: every GPU of the node.
    Never raises for a reset that could not be done: the outcome says why."""

    def reset(self, node: str, gpu: int | None) -> GpuResetOutcome: ...


@runtime_checkable
class BootClock(Protocol):
    """Backends that can tell when a node last booted (Slurm's BootTime): the witness that settles a
    reboot whose outcome a crash lost, for providers that keep no boot record of their own (EC2)."""

    def booted_at(self, node: str) -> datetime | None: ...


@dataclass(frozen=True, slots=True)
class Settled:
    """What a provider's own record says of an action asked of it before a crash cut off our record
    of the outcome."""

    done: bool  # True: it took effect (the node went down or away since); False: it never did
    detail: str


@runtime_checkable
class Reconcilable(Protocol):
    """Providers that can settle a reboot, reset or replacement whose outcome a crash lost.

    `settle` answers done only from evidence that the node went down or away since `since` (a later
    boot or launch, a terminated or replaced instance, a request the backend shows pending), not done
    only when the backend's record proves the request never took effect (the action may then be asked
    again), and None whenever it cannot tell: the intent then stays and escalates, because a second
    destructive action on a guess is worse than asking a human."""

    def settle(self, node: str, action: str, since: datetime) -> Settled | None: ...


@dataclass(frozen=True, slots=True)
class DiagnosticResult:
    node: str
    level: int
    result: str  # pass | fail | error (the test could not run: no verdict about the GPU)
    error_ids: tuple[str, ...] = ()
    detail: str = ""
    started_at: datetime | None = None
    finished_at: datetime | None = None
    # DCGM's severity of the worst failing error (DCGM_FR_* severities). For an id newer than our
    # table, the severity the output itself stated, so the policy sees more than UNKNOWN.
    worst_severity: str | None = None


@runtime_checkable
class Diagnostics(Protocol):
    def run(self, node: str, level: int, timeout_s: float) -> DiagnosticResult: ...


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU as the node's driver enumerates it: its NVLink links by state."""

    index: int
    name: str | None = None
    lost: bool = False  # enumerated, but it does not answer (fallen off the bus, GPU is lost)
    links_up: tuple[int, ...] = ()
    links_down: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class InstanceReading:
    """What the node's driver says it has. `error` set: nothing could be read, which is never a pass."""

    node: str
    gpu_count: int | None = None  # GPUs the driver enumerates
    gpus: tuple[GpuReading, ...] = ()
    error: str | None = None
    output: str = ""  # what the probe printed: the check's evidence
    started_at: datetime | None = None
    finished_at: datetime | None = None


@runtime_checkable
class InstanceProbe(Protocol):
    def read(self, node: str, timeout_s: float) -> InstanceReading: ...


@dataclass(frozen=True, slots=True)
class HostFile:
    """One piece of a node's state, as it will be kept: `name` is a plain file name."""

    name: str  # kernel-log.txt
    what: str  # for people: "kernel log (NVRM, Xid, GPU lines)"
    content: bytes


@dataclass(frozen=True, slots=True)
class HostCapture:
    """What could be read off a node before a reboot or replacement wipes it. Each part that could
    not be read (missing, failed, out of time) is a line in `missing`, never an exception."""

    node: str
    files: tuple[HostFile, ...] = ()
    missing: tuple[str, ...] = ()  # "nvidia-bug-report.sh: not installed on gpu-node-3"
    started_at: datetime | None = None
    finished_at: datetime | None = None


@runtime_checkable
class HostEvidence(Protocol):
    """Reads the state a reboot or replacement destroys (kernel log, `nvidia-smi -q`, a bug report)
    within `timeout_s` in all."""

    def capture(self, node: str, timeout_s: float) -> HostCapture: ...


@dataclass(frozen=True, slots=True)
class AllReduceSpec:
    """An all-reduce across `nodes`, one rank per GPU, scanning sizes from min to max bytes."""

    nodes: tuple[str, ...]
    gpus_per_node: int
    min_bytes: int
    max_bytes: int
    step_factor: int


@dataclass(frozen=True, slots=True)
class AllReduceRun:
    """What an all-reduce measured, read from the benchmark's own output. `error` set: no result
    could be read (it did not start, hung, died before its results, printed what we cannot read)."""

    spec: AllReduceSpec
    command: tuple[str, ...] = ()
    error: str | None = None
    ranks: int = 0
    hosts: tuple[str, ...] = ()
    largest_bytes: int | None = None
    # At the largest size: the lower of the out-of-place and in-place bus bandwidths (GB/s).
    busbw_gbps: float | None = None
    avg_busbw_gbps: float | None = None  # the benchmark's own average over every size
    out_of_bounds: int | None = None  # sizes whose results were wrong, as the benchmark counts them
    wrong: tuple[str, ...] = ()  # where wrong elements were found: "1048576 B out-of-place: 96"
    failures: tuple[str, ...] = ()  # what the run reported failing besides (a rank's test failure)
    version: str | None = None
    output: str = ""  # everything it printed: the check's evidence
    started_at: datetime | None = None
    finished_at: datetime | None = None


@runtime_checkable
class AllReduceTest(Protocol):
    def run(self, spec: AllReduceSpec, timeout_s: float) -> AllReduceRun: ...


@dataclass(frozen=True, slots=True)
class NicLoopbackRun:
    """What ib_write_bw measured in loopback on one RDMA device of a node, read from its own output.
    `missing_tool` set: the tool is not on the node, so nothing was measured (never a pass); `error`
    set: it did not start, hung, or printed no result we can read."""

    node: str
    device: str
    command: tuple[str, ...] = ()
    missing_tool: str | None = None
    error: str | None = None
    size_bytes: int | None = None
    bw_avg_gbps: float | None = None  # BW average at the largest size, in Gb/s whatever the unit printed
    bw_peak_gbps: float | None = None
    msg_rate_mpps: float | None = None
    output: str = ""  # everything it printed: the check's evidence
    started_at: datetime | None = None
    finished_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class NicLatencyRun:
    """What ib_write_lat measured in loopback on one RDMA device of a node, read from its own output:
    `missing_tool` and `error` as in `NicLoopbackRun`. The percentiles are None where the perftest on
    the node prints only t_min, t_max and t_typical (before 2016)."""

    node: str
    device: str
    command: tuple[str, ...] = ()
    missing_tool: str | None = None
    error: str | None = None
    size_bytes: int | None = None
    iterations: int | None = None
    typical_us: float | None = None  # t_typical: the median of the round trips, halved
    p99_us: float | None = None
    p999_us: float | None = None
    output: str = ""  # everything it printed: the check's evidence
    started_at: datetime | None = None
    finished_at: datetime | None = None


@runtime_checkable
class NicLoopbackTest(Protocol):
    def run(
        self, node: str, device: str, size_bytes: int, duration_s: int, timeout_s: float
    ) -> NicLoopbackRun: ...

    def latency(self, node: str, device: str, iterations: int, timeout_s: float) -> NicLatencyRun: ...


@dataclass(frozen=True, slots=True)
class Message:
    """One notification: a headline, the body in markdown-ish text, and where it should go."""

    incident: str
    channel: str
    title: str
    body: str
    recommend: tuple[str, ...] = ()
    fields: dict[str, str] = field(default_factory=dict)
    approval_run: str | None = None  # a paused flow run waiting for Approve / Reject
    artifacts: tuple[Artifact, ...] = ()  # files the evidence points at: a stack dump, a profile


@runtime_checkable
class Notifier(Protocol):
    def post(self, message: Message) -> str: ...  # returns a thread reference for replies
    def reply(self, thread: str, text: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Checkpoint:
    job: str
    step: int
    saved_at: datetime
    location: str


@runtime_checkable
class CheckpointStore(Protocol):
    def latest(self, job: str) -> Checkpoint | None: ...
