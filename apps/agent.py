"""The node agent (`medic agent`, docs/agent.md): watch this node's GPUs and report faults once.

Every poll reads NVML (integrations/nvml.py) and the new kernel-log lines, compares them with
what it saw before and emits a FaultEvent only for what changed: a new XID, uncorrected ECC
errors rising, a row remap pending or failed, fewer GPUs than expected, a PCIe link below its
capability, thermal throttling, NVLink links going down or their error counters rising, an
NVSwitch SXid, NVML itself failing. A condition that persists is reported once.
NVML errors never stop it: it backs off and opens NVML again on a later poll.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from medic.ageing import COUNTERS_ATTRIBUTE
from medic.events import EventKind, FaultEvent
from medic.facts import NVLINK_ERRORS_CHECK, SXID_CHECK
from medic.integrations.kernel_log import KernelLog, KernelSxid, KernelXid, parse_sxid, parse_xid
from medic.integrations.nvml import (
    EccCounts,
    GpuSnapshot,
    NodeSnapshot,
    NvmlXid,
    RowRemap,
    Unavailable,
)
from medic.integrations.sinks import EventSink

log = logging.getLogger(__name__)

SOURCE = "agent"
DEFAULT_INTERVAL_S = 15.0
DEFAULT_MAX_BACKOFF_S = 300.0
# The driver reports one XID both in the kernel log and as an NVML event, not necessarily in the
# same poll: the second sighting of (GPU, code) from the other source within this window is the same XID.
XID_MATCH_WINDOW_S = 60.0
# An XID NVML reports whose kernel-log line is not there yet waits this long for it once, so that its
# event carries the driver's message, pid and process rather than go out bare and drop the line later.
KERNEL_LINE_GRACE_S = 0.2
# NVLink error counters creep up on healthy links too: report once they rose by this much
# (summed over counters and links) since the last report. The policy decides what is too many.
DEFAULT_NVLINK_ERROR_MIN_RISE = 10


class GpuReader(Protocol):
    """NvmlSession's face to the agent."""

    def read(self) -> NodeSnapshot | Unavailable: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class AgentOptions:
    node: str
    switch: str | None = None
    interval_s: float = DEFAULT_INTERVAL_S
    expected_gpus: int | None = None  # None: as many as the first successful NVML read found
    max_backoff_s: float = DEFAULT_MAX_BACKOFF_S
    nvlink_error_min_rise: int = DEFAULT_NVLINK_ERROR_MIN_RISE


@dataclass(slots=True)
class _XidGroup:
    via: str  # kernel_log | nvml
    gpu: int | None
    pci: str | None
    code: int
    line: KernelXid | None
    count: int = 1

    @property
    def key(self) -> tuple[int | str, int]:
        return (self.gpu if self.gpu is not None else self.pci or "unknown", self.code)


@dataclass(slots=True)
class _Sighting:
    at: float
    key: tuple[int | str, int]  # (GPU index, or PCI bus id when unknown; XID code)
    source: str
    matched: bool = False


def _rise(before: int | None, now: int | None) -> int | None:
    """How much a counter went up; None when either reading is unknown. A drop (GPU reset) is 0."""
    if before is None or now is None:
        return None
    return max(0, now - before)


def _gpu_key(gpu: GpuSnapshot) -> str:
    # GPU indexes shift when one drops off the bus; the UUID stays with the GPU.
    return gpu.uuid or f"index-{gpu.index}"


class Agent:
    def __init__(
        self,
        options: AgentOptions,
        sink: EventSink,
        nvml: GpuReader | None,
        kernel_log: KernelLog | None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.options = options
        self.sink = sink
        self.nvml = nvml
        self.kernel_log = kernel_log
        self.clock = clock
        self.sleep = sleep
        self.expected = options.expected_gpus
        self.pci_to_gpu: dict[str, int] = {}
        self.nvml_ok: bool | None = None  # None: not read yet
        self.nvml_failures = 0
        self.next_nvml_at = 0.0
        self.last_problem: str | None = None
        self.reported_found: int | None = None
        self.ecc: dict[str, tuple[EccCounts, RowRemap | None]] = {}
        self.thermal: dict[str, tuple[str, ...]] = {}
        self.pcie: dict[str, tuple[str, ...]] = {}
        self.nvlinks_seen_up: dict[str, set[int]] = {}
        self.nvlinks_down: dict[str, frozenset[int]] = {}
        self.nvlink_errors: dict[str, dict[str, int]] = {}  # GPU -> counters at the last report
        self.sightings: deque[_Sighting] = deque()
        self.counters: dict[int, dict[str, int]] = {}  # GPU index -> its counters at this poll

    # -- one poll ---------------------------------------------------------------------------

    def poll(self) -> list[FaultEvent]:
        """Look once, emit what changed, and return it."""
        snapshot = self._read_nvml()
        # After NVML: the driver writes an XID's kernel-log line as it posts the NVML event.
        kernel_xids, kernel_sxids = self._kernel_lines()
        events = self._nvml_failed(snapshot)
        nvml_xids: tuple[NvmlXid, ...] = ()
        # This poll's counters only: a stale reading must not ride on a later event.
        self.counters = {}
        if isinstance(snapshot, NodeSnapshot):
            self.pci_to_gpu = snapshot.gpu_by_pci()
            self.counters = {g.index: g.counters() for g in snapshot.gpus if not g.lost}
            nvml_xids = snapshot.xids
            if self._line_pending(kernel_xids, nvml_xids):
                self.sleep(KERNEL_LINE_GRACE_S)
                late_xids, late_sxids = self._kernel_lines()
                kernel_xids += late_xids
                kernel_sxids += late_sxids
            events += self._gpu_count(snapshot)
            for gpu in snapshot.gpus:
                if not gpu.lost:
                    events += self._gpu_changes(gpu)
        events += self._xid_events(kernel_xids, nvml_xids)
        events += self._sxid_events(kernel_sxids)
        self.sink.emit(events)
        return events

    def run(self, stop: threading.Event) -> None:
        log.info(
            "medic agent started on %s: every %g s, NVML %s, kernel log %s",
            self.options.node,
            self.options.interval_s,
            "on" if self.nvml else "off",
            self.kernel_log.path if self.kernel_log else "off",
        )
        while not stop.is_set():
            started = self.clock()
            try:
                self.poll()
            except Exception:
                # A daemon that dies on one bad poll (full disk, a driver oddity) watches nothing.
                log.exception("poll failed; trying again in %g s", self.options.interval_s)
            stop.wait(max(0.0, self.options.interval_s - (self.clock() - started)))
        if self.nvml:
            self.nvml.close()
        log.info("medic agent stopped")

    # -- NVML -------------------------------------------------------------------------------

    def _read_nvml(self) -> NodeSnapshot | Unavailable | None:
        if self.nvml is None or self.clock() < self.next_nvml_at:
            return None
        snapshot = self.nvml.read()
        if isinstance(snapshot, Unavailable):
            self.nvml_failures += 1
            backoff = min(self.options.max_backoff_s, self.options.interval_s * 2**self.nvml_failures)
            self.next_nvml_at = self.clock() + backoff
            if snapshot.reason != self.last_problem:
                log.warning("%s; trying again in %g s", snapshot.reason, backoff)
                self.last_problem = snapshot.reason
            return snapshot
        if self.nvml_ok is not True:
            after = f" after {self.nvml_failures} failed reads" if self.nvml_failures else ""
            log.info("NVML answers%s: %d GPUs, driver %s", after, snapshot.gpu_count, snapshot.driver_version)
        self.nvml_failures, self.next_nvml_at, self.last_problem = 0, 0.0, None
        if self.expected is None:
            self.expected = snapshot.gpu_count
        self.nvml_ok = True
        return snapshot

    def _nvml_failed(self, snapshot: NodeSnapshot | Unavailable | None) -> list[FaultEvent]:
        if not isinstance(snapshot, Unavailable):
            return []
        was_ok, self.nvml_ok = self.nvml_ok, False
        if not was_ok:  # a host that never had NVML is not a fault; losing it is
            return []
        return [self._event(EventKind.HEALTH_CHECK, check="nvml", message=snapshot.reason)]

    def _gpu_count(self, snapshot: NodeSnapshot) -> list[FaultEvent]:
        assert self.expected is not None
        found = snapshot.found
        if found >= self.expected:
            self.reported_found = None
            return []
        if found == self.reported_found:
            return []
        self.reported_found = found
        lost = [g.index for g in snapshot.gpus if g.lost]
        gpu = lost[0] if len(lost) == 1 and snapshot.gpu_count >= self.expected else None
        return [
            self._event(EventKind.GPU_MISSING, gpu=gpu, expected=self.expected, found=found, lost_gpus=lost)
        ]

    def _gpu_changes(self, gpu: GpuSnapshot) -> list[FaultEvent]:
        key = _gpu_key(gpu)
        return [
            event
            for event in (
                self._ecc(key, gpu),
                self._thermal(key, gpu),
                self._pcie(key, gpu),
                self._nvlink(key, gpu),
                self._nvlink_error_counters(key, gpu),
            )
            if event is not None
        ]

    def _ecc(self, key: str, gpu: GpuSnapshot) -> FaultEvent | None:
        before = self.ecc.get(key)
        self.ecc[key] = (gpu.ecc, gpu.row_remap)
        if before is None:
            return None  # counts from before the agent started are history, not news
        ecc, remap = before
        # Volatile counts move at once; aggregate ones only when the driver writes the infoROM.
        # So the aggregate counter serves only where the volatile one is unknown.
        counter = "volatile"
        if ecc.volatile_uncorrected is None or gpu.ecc.volatile_uncorrected is None:
            counter = "aggregate"
        (dbe_was, sbe_was), (dbe_now, sbe_now) = ecc.totals(counter), gpu.ecc.totals(counter)
        dbe, sbe = _rise(dbe_was, dbe_now), _rise(sbe_was, sbe_now)
        remap_failed = gpu.row_remap is not None and gpu.row_remap.failure and not (remap and remap.failure)
        remap_pending = gpu.row_remap is not None and gpu.row_remap.pending and not (remap and remap.pending)
        if not (dbe or remap_failed or remap_pending):
            return None
        attributes: dict[str, Any] = {
            "dbe": dbe or 0,
            "sbe": sbe or 0,
            "counter": counter,
            "dbe_total": dbe_now,
            "sbe_total": sbe_now,
        }
        if gpu.row_remap is not None:
            attributes |= {
                "row_remap_pending": gpu.row_remap.pending,
                "row_remap_failure": gpu.row_remap.failure,
            }
        if gpu.retired_pages is not None:
            attributes |= {
                "retired_pages_dbe": gpu.retired_pages.dbe,
                "retired_pages_pending": gpu.retired_pages.pending,
            }
        return self._event(EventKind.ECC, gpu=gpu.index, uuid=gpu.uuid, **attributes)

    def _thermal(self, key: str, gpu: GpuSnapshot) -> FaultEvent | None:
        reasons = gpu.thermal_reasons
        if not reasons:
            self.thermal.pop(key, None)
            return None
        if self.thermal.get(key) == reasons:
            return None
        self.thermal[key] = reasons
        return self._event(
            EventKind.THERMAL,
            gpu=gpu.index,
            temperature_c=gpu.temperature_c,
            throttle_reasons=list(gpu.clock_reasons or ()),
            uuid=gpu.uuid,
        )

    def _pcie(self, key: str, gpu: GpuSnapshot) -> FaultEvent | None:
        problems = gpu.pcie.problems(gpu.idle)
        if not problems:
            self.pcie.pop(key, None)
            return None
        if self.pcie.get(key) == problems:
            return None
        self.pcie[key] = problems
        link = gpu.pcie
        return self._event(
            EventKind.HEALTH_CHECK,
            gpu=gpu.index,
            check="pcie_link",
            message=link.describe(),
            degraded=list(problems),
            pcie_gen=link.gen,
            pcie_max_gen=link.max_gen,
            pcie_width=link.width,
            pcie_max_width=link.max_width,
            uuid=gpu.uuid,
        )

    def _nvlink(self, key: str, gpu: GpuSnapshot) -> FaultEvent | None:
        if not gpu.nvlinks:
            return None
        seen_up = self.nvlinks_seen_up.setdefault(key, set())
        # A link down since we first looked may simply be unused; one that was up and went down is a fault.
        down = frozenset(link for link, up in gpu.nvlinks.items() if not up and link in seen_up)
        seen_up.update(link for link, up in gpu.nvlinks.items() if up)
        if not down:
            self.nvlinks_down.pop(key, None)
            return None
        if self.nvlinks_down.get(key) == down:
            return None
        self.nvlinks_down[key] = down
        links = sorted(down)
        return self._event(
            EventKind.HEALTH_CHECK,
            gpu=gpu.index,
            check="nvlink",
            message=f"NVLink {'link' if len(links) == 1 else 'links'} {', '.join(map(str, links))} down",
            links_down=links,
            uuid=gpu.uuid,
        )

    def _nvlink_error_counters(self, key: str, gpu: GpuSnapshot) -> FaultEvent | None:
        """NVLink error counters that rose by `nvlink_error_min_rise` or more since the last report
        (the first read is the baseline; a counter that went down, a reset, starts over)."""
        now = gpu.nvlink_errors
        if not now:
            return None
        before = self.nvlink_errors.get(key)
        if before is None or any(now.get(name, 0) < value for name, value in before.items()):
            self.nvlink_errors[key] = dict(now)
            return None
        rises = {name: value - before.get(name, value) for name, value in now.items()}
        rises = {name: rise for name, rise in rises.items() if rise > 0}
        total = sum(rises.values())
        if total < max(1, self.options.nvlink_error_min_rise):
            return None
        self.nvlink_errors[key] = dict(now)
        return self._event(
            EventKind.HEALTH_CHECK,
            gpu=gpu.index,
            check=NVLINK_ERRORS_CHECK,
            message=f"NVLink error counters rose by {total} ("
            + ", ".join(f"{name} +{rise}" for name, rise in rises.items())
            + ")",
            nvlink_errors=total,
            uuid=gpu.uuid,
            **rises,
        )

    # -- XIDs and SXids ---------------------------------------------------------------------

    def _kernel_lines(self) -> tuple[list[KernelXid], list[KernelSxid]]:
        if self.kernel_log is None:
            return [], []
        xids, sxids = [], []
        for line in self.kernel_log.new_lines():
            if xid := parse_xid(line):
                xids.append(xid)
            elif sxid := parse_sxid(line):
                sxids.append(sxid)
        return xids, sxids

    def _line_pending(self, kernel: list[KernelXid], nvml: tuple[NvmlXid, ...]) -> bool:
        """Whether NVML reports an XID whose kernel-log line has been seen neither now nor recently."""
        if self.kernel_log is None:
            return False
        # (GPU index, or None for a bus NVML did not enumerate, or a sighting's PCI bus id; XID code)
        lines: set[tuple[int | str | None, int]] = {
            (self.pci_to_gpu.get(x.pci_bus_id), x.code) for x in kernel
        }
        lines |= {s.key for s in self.sightings if s.source == "kernel_log"}
        return any((x.gpu, x.code) not in lines for x in nvml)

    def _sxid_events(self, sxids: list[KernelSxid]) -> list[FaultEvent]:
        """One event per NVSwitch and SXid code per poll (a storm is one event with a count).
        An SXid is about a switch, not a GPU: a health_check event with `check: nvswitch_sxid`."""
        groups: dict[tuple[str, int], list[KernelSxid]] = {}
        for sxid in sxids:
            groups.setdefault((sxid.nvswitch, sxid.code), []).append(sxid)
        events = []
        for seen in groups.values():
            first = seen[0]
            events.append(
                self._event(
                    EventKind.HEALTH_CHECK,
                    check=SXID_CHECK,
                    message=f"{first.nvswitch}: SXid {first.code}, {first.message}".rstrip(", "),
                    sxid=first.code,
                    fatal=any(s.fatal for s in seen) if any(s.fatal is not None for s in seen) else None,
                    nvswitch=first.nvswitch,
                    pci_bus_id=first.pci_bus_id,
                    link=first.link,
                    count=len(seen) if len(seen) > 1 else None,
                )
            )
        return events

    def _xid_events(self, kernel: list[KernelXid], nvml: tuple[NvmlXid, ...]) -> list[FaultEvent]:
        now = self.clock()
        while self.sightings and now - self.sightings[0].at > XID_MATCH_WINDOW_S:
            self.sightings.popleft()
        gpu_to_pci: dict[int | None, str] = {index: pci for pci, index in self.pci_to_gpu.items()}
        # One event per XID code per GPU per source and poll: an XID 13 storm is one event with a count.
        groups: dict[tuple[str, int | str, int], _XidGroup] = {}
        found = [
            _XidGroup("kernel_log", self.pci_to_gpu.get(x.pci_bus_id), x.pci_bus_id, x.code, x)
            for x in kernel
        ]
        found += [_XidGroup("nvml", x.gpu, gpu_to_pci.get(x.gpu), x.code, None) for x in nvml]
        for xid in found:
            group = groups.setdefault((xid.via, *xid.key), xid)
            if group is not xid:
                group.count += 1
        # Kernel-log sightings go first: their event carries the driver's message.
        return [self._xid_event(xid) for xid in groups.values() if not self._seen_elsewhere(xid, now)]

    def _seen_elsewhere(self, xid: _XidGroup, now: float) -> bool:
        """Whether the other source already reported this XID; records this sighting otherwise."""
        for sighting in self.sightings:
            if sighting.key == xid.key and sighting.source != xid.via and not sighting.matched:
                sighting.matched = True
                return True
        self.sightings.append(_Sighting(now, xid.key, xid.via))
        return False

    def _xid_event(self, xid: _XidGroup) -> FaultEvent:
        attributes: dict[str, Any] = {"code": xid.code, "via": xid.via, "pci_bus_id": xid.pci}
        if xid.line is not None:
            attributes |= {
                "message": xid.line.message,
                "pid": xid.line.pid,
                "process": xid.line.process,
                "gpu_instance": xid.line.gpu_instance,
                "compute_instance": xid.line.compute_instance,
            }
        if xid.count > 1:
            attributes["count"] = xid.count
        return self._event(EventKind.XID, gpu=xid.gpu, **attributes)

    # -- events -----------------------------------------------------------------------------

    def _event(self, kind: EventKind, gpu: int | None = None, **attributes: Any) -> FaultEvent:
        # Every event about a GPU carries its counters: the readings hardware ageing trends.
        if gpu is not None:
            attributes.setdefault(COUNTERS_ATTRIBUTE, self.counters.get(gpu) or None)
        return FaultEvent(
            id=f"agent-{uuid.uuid4().hex}",
            time=datetime.now(UTC),
            source=SOURCE,
            kind=kind,
            node=self.options.node,
            gpu=gpu,
            switch=self.options.switch,
            attributes={name: value for name, value in attributes.items() if value is not None},
        )
