"""GPU health from NVML through nvidia-ml-py (import name `pynvml`): one `NodeSnapshot` per read
(the types are the domain's, medic/gpu_state.py: the agent's rules judge them without pynvml).

Every field an NVML call cannot answer on this GPU or driver (NotSupported, a function the driver
lacks, no permission) is None: unknown, never a guessed zero. A GPU that is lost mid-read is
reported on that GPU (`lost`), not raised. A host without a working driver gives `Unavailable`.
A session asks a GPU for a field it answered NotSupported (or lacked the function for) only once.

`NvmlSession` keeps NVML initialised between reads and holds an event set registered for XID
critical errors, so XIDs that happened between two reads are delivered at the next one (the
driver queues them). `snapshot()` is one read in a fresh session, for one-off checks;
`python -m medic.integrations.nvml` prints one as JSON, for a probe run on the node from elsewhere
(medic/integrations/nvml_probe.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self, TypeVar

import pynvml

from medic.gpu_state import (
    EccCounts,
    GpuSnapshot,
    NodeSnapshot,
    NvmlXid,
    PcieLink,
    RetiredPages,
    RowRemap,
    Unavailable,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Clock event ("throttle") reason bits, named as docs/events.md writes them.
CLOCK_EVENT_REASONS: dict[int, str] = {
    pynvml.nvmlClocksEventReasonGpuIdle: "gpu_idle",
    pynvml.nvmlClocksEventReasonApplicationsClocksSetting: "applications_clocks_setting",
    pynvml.nvmlClocksEventReasonSwPowerCap: "sw_power_cap",
    pynvml.nvmlClocksEventReasonHwSlowdown: "hw_slowdown",
    pynvml.nvmlClocksEventReasonSyncBoost: "sync_boost",
    pynvml.nvmlClocksEventReasonSwThermalSlowdown: "sw_thermal_slowdown",
    pynvml.nvmlClocksEventReasonHwThermalSlowdown: "hw_thermal_slowdown",
    pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown: "hw_power_brake_slowdown",
    pynvml.nvmlClocksEventReasonDisplayClockSetting: "display_clock_setting",
}

# The call has no answer on this GPU or driver: the field is unknown.
UNANSWERED = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_FunctionNotFound,
    pynvml.NVMLError_NoPermission,
)
# Of those, the answers that hold for as long as the driver is loaded.
NEVER_ANSWERED = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
# NVML itself is gone (driver unloaded, library mismatch): the whole read fails.
NODE_FAILURES = (
    pynvml.NVMLError_Uninitialized,
    pynvml.NVMLError_DriverNotLoaded,
    pynvml.NVMLError_LibraryNotFound,
    pynvml.NVMLError_LibRmVersionMismatch,
)
# NVLink state is asked per link up to NVML's limit; past a board's last link NVML answers
# InvalidArgument, and a board without NVLink answers NotSupported.
NVLINK_PROBE_ERRORS = (*UNANSWERED, pynvml.NVMLError_InvalidArgument)
# NVLink error counters, per link, summed over the GPU's links (nvmlDeviceGetNvLinkErrorCounter).
NVLINK_ERROR_COUNTERS: dict[int, str] = {
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
    pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
    pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA: "ecc_data",
}
EVENT_WAIT_MS = 1
MAX_EVENTS_PER_READ = 256  # an XID storm is drained over several reads, never in one endless loop


def decode_clock_reasons(mask: int) -> tuple[str, ...]:
    """Names of the set bits; a bit this table does not know is kept as `bit_N`."""
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    known = sum(CLOCK_EVENT_REASONS)
    names += [f"bit_{n}" for n in range(64) if mask & ~known & (1 << n)]
    return tuple(names)


def normalize_pci_bus_id(bus_id: str) -> str:
    """`00000000:3B:00.0` (NVML) and `0000:3b:00` (kernel log) both become `0000:3b:00`."""
    address = bus_id.strip().lower().removeprefix("pci:")
    domain, _, rest = address.partition(":")
    bus_device = rest.split(".")[0]
    return f"{int(domain, 16):04x}:{bus_device}" if domain else bus_device


class _GpuLost(Exception):
    pass


class _Reader:
    """The fields of one GPU: each call's unknowns become None and its errors are collected.

    `never` holds the fields this GPU and driver answered NotSupported or FunctionNotFound: they are
    not asked again while the driver is up (Hopper's retired-pages queries took 0.42 ms of a 0.6 ms
    read, every tick, to say NotSupported)."""

    def __init__(self, handle: Any, never: set[str] | None = None) -> None:
        self.handle = handle
        self.errors: list[str] = []
        self.never = set() if never is None else never

    def get(self, what: str, call: Callable[..., T], *args: Any) -> T | None:
        if what in self.never:
            return None
        try:
            return call(self.handle, *args)
        except NEVER_ANSWERED:
            self.never.add(what)
            return None
        except UNANSWERED:
            return None
        except pynvml.NVMLError_GpuIsLost:
            raise _GpuLost from None
        except NODE_FAILURES:
            raise
        except pynvml.NVMLError as error:
            self.errors.append(f"{what}: {error}")
            return None


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def _clock_reasons(handle: Any) -> int:
    # The Event name came with driver R535; older drivers only have the Throttle one.
    try:
        return pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
    except pynvml.NVMLError_FunctionNotFound:
        return pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)


def _retired_pages(reader: _Reader) -> RetiredPages | None:
    cause = (
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
    )
    sbe = reader.get("retired pages (sbe)", pynvml.nvmlDeviceGetRetiredPages, cause[0])
    dbe = reader.get("retired pages (dbe)", pynvml.nvmlDeviceGetRetiredPages, cause[1])
    pending = reader.get("retired pages pending", pynvml.nvmlDeviceGetRetiredPagesPendingStatus)
    if sbe is None and dbe is None and pending is None:
        return None
    return RetiredPages(
        None if sbe is None else len(sbe),
        None if dbe is None else len(dbe),
        None if pending is None else bool(pending),
    )


def _ecc(reader: _Reader) -> EccCounts:
    def count(error_type: int, counter: int, what: str) -> int | None:
        return reader.get(what, pynvml.nvmlDeviceGetTotalEccErrors, error_type, counter)

    corrected, uncorrected = (
        pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    )
    volatile, aggregate = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
    return EccCounts(
        count(corrected, volatile, "ecc volatile corrected"),
        count(uncorrected, volatile, "ecc volatile uncorrected"),
        count(corrected, aggregate, "ecc aggregate corrected"),
        count(uncorrected, aggregate, "ecc aggregate uncorrected"),
    )


def _nvlink_errors(reader: _Reader, links: tuple[int, ...]) -> dict[str, int] | None:
    """Each error counter summed over `links`. A counter a link cannot answer (an older GPU has
    no ECC counter, say) is left out for that link; one no link answers is absent. Each link's
    counter is a field of its own to `_Reader.get`: one answered NotSupported is not asked again
    (90 calls per GPU on every poll: 18 links, 5 counters)."""
    totals: dict[str, int] = {}
    for link in links:
        for counter, name in NVLINK_ERROR_COUNTERS.items():
            what = f"nvlink {link} {name} errors"
            value = reader.get(what, pynvml.nvmlDeviceGetNvLinkErrorCounter, link, counter)
            if value is not None:
                totals[name] = totals.get(name, 0) + int(value)
    return totals or None


class NvmlSession:
    """NVML initialised once for many reads; `read()` never raises for NVML's sake.

    After a read that fails as a whole the session closes itself; the next read opens it again.
    """

    def __init__(self, event_wait_ms: int = EVENT_WAIT_MS) -> None:
        self.event_wait_ms = event_wait_ms
        self._open = False
        self._event_set: Any = None
        self._nvlinks: dict[int, tuple[int, ...]] = {}  # GPU index -> links that answered once
        self._never: dict[int, set[str]] = {}  # GPU index -> fields it never answers (_Reader)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def read(self) -> NodeSnapshot | Unavailable:
        try:
            if not self._open:
                self._start()
            return self._read()
        except pynvml.NVMLError as error:  # no library or driver, or NVML failing as a whole
            self.close()
            return Unavailable(f"NVML: {error}")

    def close(self) -> None:
        if self._event_set is not None:
            try:
                pynvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError as error:
                log.debug("nvmlEventSetFree: %s", error)
            self._event_set = None
        if self._open:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as error:
                log.debug("nvmlShutdown: %s", error)
            self._open = False
        self._nvlinks.clear()
        self._never.clear()

    def _start(self) -> None:
        pynvml.nvmlInit()
        self._open = True
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except UNANSWERED:
            self._event_set = None  # no NVML XIDs here: the kernel log still has them
        if self._event_set is None:
            return
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._event_set)
            except NODE_FAILURES:
                raise
            except pynvml.NVMLError as error:
                log.info("GPU %d: no XID events from NVML (%s)", index, error)

    def _read(self) -> NodeSnapshot:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        count = pynvml.nvmlDeviceGetCount()
        gpus: list[GpuSnapshot] = []
        addresses: dict[int | None, int] = {}
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except NODE_FAILURES:
                raise
            except pynvml.NVMLError as error:  # lost, or no permission for this one GPU
                gpus.append(GpuSnapshot(index, lost=True, errors=(f"handle: {error}",)))
                continue
            addresses[_address(handle)] = index
            gpus.append(self._gpu(index, handle))
        return NodeSnapshot(driver, count, tuple(gpus), self._xids(addresses))

    def _gpu(self, index: int, handle: Any) -> GpuSnapshot:
        reader = _Reader(handle, self._never.setdefault(index, set()))
        facts: dict[str, Any] = {}
        try:
            facts["uuid"] = reader.get("uuid", pynvml.nvmlDeviceGetUUID)
            pci = reader.get("pci info", pynvml.nvmlDeviceGetPciInfo_v3)
            facts["pci_bus_id"] = None if pci is None else normalize_pci_bus_id(_text(pci.busId))
            name = reader.get("name", pynvml.nvmlDeviceGetName)
            facts["name"] = None if name is None else _text(name)
            facts["ecc"] = _ecc(reader)
            facts["retired_pages"] = _retired_pages(reader)
            remap = reader.get("remapped rows", pynvml.nvmlDeviceGetRemappedRows)
            if remap is not None:
                corrected, uncorrected, pending, failure = remap
                facts["row_remap"] = RowRemap(corrected, uncorrected, bool(pending), bool(failure))
            facts["temperature_c"] = reader.get(
                "temperature", pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU
            )
            mask = reader.get("clock event reasons", _clock_reasons)
            facts["clock_reasons"] = None if mask is None else decode_clock_reasons(mask)
            milliwatts = reader.get("power", pynvml.nvmlDeviceGetPowerUsage)
            facts["power_w"] = None if milliwatts is None else milliwatts / 1000
            mode = reader.get("persistence mode", pynvml.nvmlDeviceGetPersistenceMode)
            facts["persistence_mode"] = None if mode is None else mode == pynvml.NVML_FEATURE_ENABLED
            facts["pcie"] = PcieLink(
                reader.get("pcie gen", pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
                reader.get("pcie max gen", pynvml.nvmlDeviceGetMaxPcieLinkGeneration),
                reader.get("pcie width", pynvml.nvmlDeviceGetCurrPcieLinkWidth),
                reader.get("pcie max width", pynvml.nvmlDeviceGetMaxPcieLinkWidth),
            )
            facts["nvlinks"] = self._nvlink_states(index, reader)
            facts["nvlink_errors"] = _nvlink_errors(reader, tuple(facts["nvlinks"] or ()))
        except _GpuLost:
            # What was read before the loss still identifies the GPU.
            keep = {k: facts[k] for k in ("uuid", "pci_bus_id", "name") if k in facts}
            return GpuSnapshot(index, lost=True, errors=tuple(reader.errors), **keep)
        return GpuSnapshot(
            index, errors=tuple(reader.errors), unsupported=tuple(sorted(reader.never)), **facts
        )

    def _nvlink_states(self, index: int, reader: _Reader) -> dict[int, bool] | None:
        """Up/down per link. The first read probes every link NVML could have; later reads ask
        only the links that answered then (links do not come and go while the driver is up)."""
        links = self._nvlinks.get(index)
        states: dict[int, bool] = {}
        for link in links if links is not None else range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                states[link] = (
                    pynvml.nvmlDeviceGetNvLinkState(reader.handle, link) == pynvml.NVML_FEATURE_ENABLED
                )
            except NVLINK_PROBE_ERRORS:
                if links is None and states:
                    break  # past the board's last link
            except pynvml.NVMLError_GpuIsLost:
                raise _GpuLost from None
            except NODE_FAILURES:
                raise
            except pynvml.NVMLError as error:
                reader.errors.append(f"nvlink {link}: {error}")
        if links is None:
            self._nvlinks[index] = tuple(states)
        return states or None

    def _xids(self, addresses: dict[int | None, int]) -> tuple[NvmlXid, ...]:
        if self._event_set is None:
            return ()
        xids = []
        for _ in range(MAX_EVENTS_PER_READ):
            try:
                data = pynvml.nvmlEventSetWait(self._event_set, self.event_wait_ms)
            except pynvml.NVMLError_Timeout:
                break
            except NODE_FAILURES:
                raise
            except pynvml.NVMLError as error:
                log.warning("nvmlEventSetWait: %s", error)
                break
            if data.eventType == pynvml.nvmlEventTypeXidCriticalError:
                xids.append(NvmlXid(addresses.get(_address(data.device)), int(data.eventData)))
        return tuple(xids)


def snapshot() -> NodeSnapshot | Unavailable:
    """One read of this node's GPUs. Its XIDs are only those delivered while it reads: an event
    set sees nothing from before it existed (the kernel log has those)."""
    with NvmlSession() as session:
        return session.read()


def main() -> None:
    result = snapshot()
    print(json.dumps({"type": type(result).__name__, **dataclasses.asdict(result)}))


if __name__ == "__main__":
    main()
