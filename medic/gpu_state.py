"""What a node's GPUs looked like at one read: NVML's snapshot, and the XID and SXid lines the
NVIDIA drivers wrote to the kernel log.

Plain values, no I/O: medic/integrations/nvml.py and medic/integrations/kernel_log.py read the node and build
them; the rules that judge them live in the domain (medic/detection.py, the agent's fault
detection) and must not import the readers, which load pynvml and touch files.

Every NVML field a GPU or driver could not answer is None: unknown, never a guessed zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The clock event ("throttle") reasons that mean heat, named as docs/events.md writes them.
THERMAL_REASONS = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown"})


# -- NVML -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EccCounts:
    """Volatile: since the driver loaded (a GPU reset clears them). Aggregate: the GPU's lifetime."""

    volatile_corrected: int | None = None
    volatile_uncorrected: int | None = None
    aggregate_corrected: int | None = None
    aggregate_uncorrected: int | None = None

    def totals(self, counter: str) -> tuple[int | None, int | None]:
        """(uncorrected, corrected) of the `volatile` or `aggregate` counter."""
        if counter == "volatile":
            return self.volatile_uncorrected, self.volatile_corrected
        return self.aggregate_uncorrected, self.aggregate_corrected


@dataclass(frozen=True, slots=True)
class RetiredPages:
    """Page retirement (GPUs before Ampere)."""

    sbe: int | None = None
    dbe: int | None = None
    pending: bool | None = None


@dataclass(frozen=True, slots=True)
class RowRemap:
    """Row remapping (Ampere and later): replaces page retirement."""

    corrected: int
    uncorrected: int
    pending: bool
    failure: bool


@dataclass(frozen=True, slots=True)
class PcieLink:
    gen: int | None = None
    max_gen: int | None = None
    width: int | None = None
    max_width: int | None = None

    def problems(self, idle: bool) -> tuple[str, ...]:
        """How the link runs below what it can: `width` and/or `gen`. An idle GPU lowers its link
        generation to save power, so a lower generation counts only on a GPU that is not idle."""
        narrow = self.width is not None and self.max_width is not None and self.width < self.max_width
        slow = not idle and self.gen is not None and self.max_gen is not None and self.gen < self.max_gen
        return ("width",) * narrow + ("gen",) * slow

    def describe(self) -> str:
        return f"PCIe link at Gen{self.gen} x{self.width}, capable of Gen{self.max_gen} x{self.max_width}"


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    index: int
    uuid: str | None = None
    pci_bus_id: str | None = None  # normalized: 0000:3b:00
    name: str | None = None
    lost: bool = False  # did not answer: NVML says the GPU is lost, or gives no handle for it
    ecc: EccCounts = field(default_factory=EccCounts)
    retired_pages: RetiredPages | None = None
    row_remap: RowRemap | None = None
    temperature_c: int | None = None
    clock_reasons: tuple[str, ...] | None = None
    power_w: float | None = None
    pcie: PcieLink = field(default_factory=PcieLink)
    nvlinks: dict[int, bool] | None = None  # link -> up; links NVML could not answer are absent
    # NVLink error counters (replay, recovery, crc_flit, crc_data, ecc_data), summed over the
    # links that answered; a counter no link answered is absent. None: no NVLink or no answer.
    nvlink_errors: dict[str, int] | None = None
    errors: tuple[str, ...] = ()  # calls that failed for another reason: "temperature: Unknown Error"
    persistence_mode: bool | None = None
    # Fields this GPU and driver answered NotSupported (or lacked the function for), named as in
    # `errors`: unknown because the GPU has no such thing, not because NVML failed to answer.
    unsupported: tuple[str, ...] = ()

    @property
    def idle(self) -> bool:
        return "gpu_idle" in (self.clock_reasons or ())

    @property
    def thermal_reasons(self) -> tuple[str, ...]:
        return tuple(r for r in self.clock_reasons or () if r in THERMAL_REASONS)

    def counters(self) -> dict[str, int]:
        """The counters hardware ageing follows (docs/events.md, `counters`): lifetime ECC counts,
        rows remapped, NVLink CRC errors. One NVML did not answer is left out, never zero."""
        crc = [v for k, v in (self.nvlink_errors or {}).items() if k in ("crc_flit", "crc_data")]
        remap = self.row_remap
        found = {
            "ecc_corrected": self.ecc.aggregate_corrected,
            "ecc_uncorrected": self.ecc.aggregate_uncorrected,
            "row_remap_corrected": remap.corrected if remap else None,
            "row_remap_uncorrected": remap.uncorrected if remap else None,
            "nvlink_crc": sum(crc) if crc else None,
        }
        return {name: value for name, value in found.items() if value is not None}


@dataclass(frozen=True, slots=True)
class NvmlXid:
    gpu: int | None  # None: the event named a device this read did not enumerate
    code: int


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    driver_version: str | None
    gpu_count: int
    gpus: tuple[GpuSnapshot, ...]
    xids: tuple[NvmlXid, ...] = ()

    @property
    def found(self) -> int:
        """GPUs that answer: enumerated and not lost."""
        return sum(1 for g in self.gpus if not g.lost)

    def gpu_by_pci(self) -> dict[str, int]:
        return {g.pci_bus_id: g.index for g in self.gpus if g.pci_bus_id}


@dataclass(frozen=True, slots=True)
class Unavailable:
    """NVML did not answer at all (no library, no driver, or failing as a whole), and why."""

    reason: str


# -- the kernel log -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KernelXid:
    pci_bus_id: str  # normalized: 0000:3b:00
    code: int
    message: str
    pid: int | None = None
    process: str | None = None
    gpu_instance: int | None = None  # MIG: the GPU instance the driver attributes the XID to
    compute_instance: int | None = None


@dataclass(frozen=True, slots=True)
class KernelSxid:
    """An NVSwitch error: reported about a switch, not a GPU."""

    nvswitch: str  # nvswitch0
    pci_bus_id: str  # the switch's, normalized: 0000:05:00
    code: int
    message: str
    fatal: bool | None = None  # None: the line says neither Fatal nor Non-fatal
    link: int | None = None
