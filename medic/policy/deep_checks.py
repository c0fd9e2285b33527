"""The policy's `deep_checks` section: what a node of each shape must show before it returns to
service after a replacement or a repair (docs/deep-checks.md)."""

from __future__ import annotations

from enum import StrEnum
from fnmatch import fnmatchcase
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

# nccl-tests' own default largest size for a multi-node scan (its README): large enough that the
# bus bandwidth has reached its plateau, so a floor judged there is about the links, not latency.
DEFAULT_MAX_BYTES = 8 * 1024**3
Bandwidth = Annotated[float, Field(gt=0, le=100_000)]  # GB/s; above any link built
NicBandwidth = Annotated[float, Field(gt=0, le=10_000)]  # Gb/s, as perftest reports; above any NIC built
NicLatency = Annotated[float, Field(gt=0, le=1_000_000)]  # µs, as perftest reports; a second is no RDMA link
RdmaDevice = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]  # goes on the node's command line


class CheckName(StrEnum):
    GPU_COUNT = "gpu_count"
    NVLINK = "nvlink"
    DCGM = "dcgm"
    NIC_LOOPBACK = "nic_loopback"
    ALL_REDUCE = "all_reduce"


# The order the suite runs and reports them: the cheap reads first, the all-reduce last.
CHECK_ORDER = tuple(CheckName)
# The checks that load every GPU (or saturate the node's NICs): never beside a job.
STRESS_CHECKS = frozenset({CheckName.DCGM, CheckName.NIC_LOOPBACK, CheckName.ALL_REDUCE})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Shape(_Strict):
    """What a healthy node of one kind has, and the all-reduce bandwidth it must reach."""

    gpus: PositiveInt = Field(description="GPUs the driver must enumerate, every one answering.")
    nvlinks_per_gpu: int = Field(
        0, ge=0, le=64, description="NVLink links up on every GPU (0: a PCIe-only node, not checked)."
    )
    busbw_floor_gbps: Bandwidth = Field(
        description="Lowest all-reduce bus bandwidth (nccl-tests busbw, GB/s) across the node's own GPUs, "
        "at the largest size."
    )
    multi_node_busbw_floor_gbps: Bandwidth | None = Field(
        None,
        description="Lowest busbw of an all-reduce across several nodes of this shape (the network's "
        "share); default: busbw_floor_gbps.",
    )
    rdma_devices: tuple[RdmaDevice, ...] = Field(
        (),
        description="RDMA devices (mlx5_0) the nic_loopback check runs ib_write_bw and ib_write_lat on, one "
        "after the other (none: nothing to check).",
    )
    nic_bw_floor_gbps: NicBandwidth | None = Field(
        None,
        description="Lowest ib_write_bw loopback bandwidth (BW average, Gb/s) of each RDMA device; "
        "none: measured and reported, not judged.",
    )
    nic_lat_ceiling_us: NicLatency | None = Field(
        None,
        description="Highest ib_write_lat loopback latency (t_typical, the median, µs) of each RDMA device; "
        "none: measured and reported, not judged.",
    )

    def floor(self, nodes: int) -> float:
        if nodes > 1 and self.multi_node_busbw_floor_gbps is not None:
            return self.multi_node_busbw_floor_gbps
        return self.busbw_floor_gbps


class AllReduceSizes(_Strict):
    """The sizes nccl-tests' all_reduce_perf scans (-b, -e, -f); the floor is judged at the largest."""

    min_bytes: PositiveInt = 8
    max_bytes: PositiveInt = Field(DEFAULT_MAX_BYTES, le=1024**4)
    step_factor: int = Field(2, ge=2, le=1024)
    timeout_seconds: float = Field(1800, gt=0, le=86_400, description="Hard limit for one all-reduce run.")

    @model_validator(mode="after")
    def _ordered(self) -> AllReduceSizes:
        if self.min_bytes > self.max_bytes:
            raise ValueError("min_bytes is larger than max_bytes")
        return self


class NicLoopback(_Strict):
    """How perftest's ib_write_bw, then ib_write_lat, run in loopback on each RDMA device of a node."""

    size_bytes: PositiveInt = Field(
        8 * 1024**2, le=1024**3, description="ib_write_bw's message size (-s): large enough to fill the link."
    )
    duration_seconds: int = Field(
        5, ge=1, le=600, description="How long ib_write_bw measures each device (-D)."
    )
    latency_iterations: int = Field(
        1000,
        ge=10,
        le=1_000_000,
        description="Round trips ib_write_lat times on each device (-n; 1000 is perftest's default), at its "
        "default 2-byte message: its median and percentiles need counted iterations, a duration gives only "
        "an average.",
    )
    timeout_seconds: float = Field(
        120,
        gt=0,
        le=3600,
        description="Hard limit for one device's run of each tool, the server's start included.",
    )


class Required(_Strict):
    """The checks a node must pass before it returns to service, per transition."""

    after_replace: list[CheckName] = Field(
        default_factory=list, description="After a replacement: new hardware, nothing known about it."
    )
    after_repair: list[CheckName] = Field(default_factory=list, description="After a reboot or a GPU reset.")


class DeepChecks(_Strict):
    dcgm_level: int = Field(4, ge=1, le=4, description="The DCGM diagnostic level the `dcgm` check runs.")
    shapes: dict[str, Shape] = Field(default_factory=dict, description="Shape name -> what it has.")
    nodes: dict[str, str] = Field(
        default_factory=dict,
        description="Node name or shell pattern (gpu-h100-*) -> shape name; the first match in file order.",
    )
    all_reduce: AllReduceSizes = Field(default_factory=AllReduceSizes)
    nic_loopback: NicLoopback = Field(default_factory=NicLoopback)
    require: Required = Field(default_factory=Required)

    # Field validators, so that a mistake is reported at its own key's line.
    @field_validator("nodes")
    @classmethod
    def _known_shapes(cls, nodes: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        shapes = info.data.get("shapes", {})
        unknown = sorted({s for s in nodes.values() if s not in shapes})
        if unknown:
            known = ", ".join(sorted(shapes)) or "none"
            raise ValueError(
                f"names shapes that `shapes` does not define: {', '.join(unknown)} (known: {known})"
            )
        return nodes

    @field_validator("require")
    @classmethod
    def _shaped_nodes(cls, require: Required, info: ValidationInfo) -> Required:
        shaped = {*require.after_replace, *require.after_repair} - {CheckName.DCGM}
        if shaped and info.data.get("nodes") == {}:  # absent: `nodes` itself was refused
            # Every such check would find no shape to judge against: no node could ever return.
            raise ValueError(
                f"names {', '.join(sorted(shaped))}, which judge a node against its shape, "
                "but `nodes` gives no node a shape"
            )
        return require

    def shape_of(self, node: str) -> tuple[str, Shape] | None:
        """The node's shape: that of the first pattern in `nodes` it matches; None when none does."""
        for pattern, name in self.nodes.items():
            if fnmatchcase(node, pattern):
                return name, self.shapes[name]
        return None

    def required(self, replaced: bool) -> tuple[CheckName, ...]:
        """The checks the transition back to service requires, in the order the suite runs them."""
        wanted = set(self.require.after_replace if replaced else self.require.after_repair)
        return tuple(c for c in CHECK_ORDER if c in wanted)
