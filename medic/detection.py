"""The node agent's fault detection (docs/agent.md): which changes in what a node's GPUs show
become FaultEvents, each reported once.

A `FaultDetector` is handed one poll's observations at a time (NVML's snapshot or why there was
none, the driver's new XID and SXid lines from the kernel log, the time) and compares them with
what it saw before. It returns an event only for what changed: a new XID, uncorrected ECC errors
rising, a row remap pending or failed, fewer GPUs than expected, a PCIe link below its
capability, thermal throttling, NVLink links going down or their error counters rising, an
NVSwitch SXid, NVML itself failing. A condition that persists is reported once.

Pure, as medic/preflight.py is for the Slurm prolog: the agent (medic/apps/agent.py) reads NVML and the
kernel log, backs off, waits and sends; these rules decide. So they are tested on values, with no
NVML, no kernel log, no sink and no clock but the one given.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from medic.ageing import COUNTERS_ATTRIBUTE
from medic.events import EventKind, FaultEvent
from medic.facts import NVLINK_ERRORS_CHECK, SXID_CHECK
from medic.gpu_state import (
    EccCounts,
    GpuSnapshot,
    KernelSxid,
    KernelXid,
    NodeSnapshot,
    NvmlXid,
    RowRemap,
    Unavailable,
)

SOURCE = "agent"
# The driver reports one XID both in the kernel log and as an NVML event, not necessarily in the
# same poll: the second sighting of (GPU, code) from the other source within this window is the same XID.
XID_MATCH_WINDOW_S = 60.0
# NVLink error counters creep up on healthy links too: report once they rose by this much
# (summed over counters and links) since the last report. The policy decides what is too many.
DEFAULT_NVLINK_ERROR_MIN_RISE = 10


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


class FaultDetector:
    """One node's fault rules and what they remember between polls: baselines, conditions already
    reported, recent XID sightings. `observe` once per poll, in order."""

    def __init__(
        self,
        node: str,
        switch: str | None = None,
        expected_gpus: int | None = None,
        nvlink_error_min_rise: int = DEFAULT_NVLINK_ERROR_MIN_RISE,
    ) -> None:
        self.node = node
        self.switch = switch
        self.expected = expected_gpus  # None: as many as the first NVML snapshot has
        self.nvlink_error_min_rise = nvlink_error_min_rise
        self.pci_to_gpu: dict[str, int] = {}  # from the last snapshot: kernel-log XIDs name a PCI bus
        self.nvml_ok: bool | None = None  # whether the last NVML read answered; None: none yet
        self.reported_found: int | None = None
        self.ecc: dict[str, tuple[EccCounts, RowRemap | None]] = {}
        self.thermal: dict[str, tuple[str, ...]] = {}
        self.pcie: dict[str, tuple[str, ...]] = {}
        self.nvlinks_seen_up: dict[str, set[int]] = {}
        self.nvlinks_down: dict[str, frozenset[int]] = {}
        self.nvlink_errors: dict[str, dict[str, int]] = {}  # GPU -> counters at the last report
        self.sightings: deque[_Sighting] = deque()
        # This poll's only: a stale reading must not ride on a later event.
        self.counters: dict[int, dict[str, int]] = {}  # GPU index -> its counters at this poll
        self.time: datetime | None = None  # this poll's, the time of its events

    # -- one poll ---------------------------------------------------------------------------

    def observe(
        self,
        nvml: NodeSnapshot | Unavailable | None,
        kernel_xids: Sequence[KernelXid] = (),
        kernel_sxids: Sequence[KernelSxid] = (),
        *,
        clock_s: float,
        time: datetime,
    ) -> list[FaultEvent]:
        """The events for what changed since the last poll.

        `nvml`: this poll's snapshot, `Unavailable` when the read failed, None when NVML was not
        read (not used here, or backing off). `clock_s`: a monotonic clock, in seconds, that the
        XID match window is measured on (a wall-clock step must not stretch or shut it); `time`:
        when, for the events."""
        self.time = time
        events = self._nvml_failed(nvml)
        nvml_xids: tuple[NvmlXid, ...] = ()
        self.counters = {}
        if isinstance(nvml, NodeSnapshot):
            self.nvml_ok = True
            if self.expected is None:
                self.expected = nvml.gpu_count
            self.pci_to_gpu = nvml.gpu_by_pci()
            self.counters = {g.index: g.counters() for g in nvml.gpus if not g.lost}
            nvml_xids = nvml.xids
            events += self._gpu_count(nvml)
            for gpu in nvml.gpus:
                if not gpu.lost:
                    events += self._gpu_changes(gpu)
        events += self._xid_events(kernel_xids, nvml_xids, clock_s)
        events += self._sxid_events(kernel_sxids)
        return events

    def awaits_kernel_line(self, nvml: NodeSnapshot, kernel_xids: Sequence[KernelXid]) -> bool:
        """Whether `nvml` reports an XID whose kernel-log line is neither in `kernel_xids` nor among
        the recent sightings: worth a short wait for, since the line has the driver's message, pid
        and process, and an event sent without it would make the line a duplicate later."""
        pci_to_gpu = nvml.gpu_by_pci()
        # (GPU index, or None for a bus NVML did not enumerate, or a sighting's PCI bus id; XID code)
        lines: set[tuple[int | str | None, int]] = {
            (pci_to_gpu.get(x.pci_bus_id), x.code) for x in kernel_xids
        }
        lines |= {s.key for s in self.sightings if s.source == "kernel_log"}
        return any((x.gpu, x.code) not in lines for x in nvml.xids)

    # -- NVML -------------------------------------------------------------------------------

    def _nvml_failed(self, nvml: NodeSnapshot | Unavailable | None) -> list[FaultEvent]:
        if not isinstance(nvml, Unavailable):
            return []
        was_ok, self.nvml_ok = self.nvml_ok, False
        if not was_ok:  # a host that never had NVML is not a fault; losing it is
            return []
        return [self._event(EventKind.HEALTH_CHECK, check="nvml", message=nvml.reason)]

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
        if total < max(1, self.nvlink_error_min_rise):
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

    def _sxid_events(self, sxids: Sequence[KernelSxid]) -> list[FaultEvent]:
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

    def _xid_events(
        self, kernel: Sequence[KernelXid], nvml: tuple[NvmlXid, ...], now: float
    ) -> list[FaultEvent]:
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
        assert self.time is not None  # set by observe, the only way in
        # Every event about a GPU carries its counters: the readings hardware ageing trends.
        if gpu is not None:
            attributes.setdefault(COUNTERS_ATTRIBUTE, self.counters.get(gpu) or None)
        return FaultEvent(
            # The one thing not given: a random id, unique per report. What is reported is decided above.
            id=f"{SOURCE}-{uuid.uuid4().hex}",
            time=self.time,
            source=SOURCE,
            kind=kind,
            node=self.node,
            gpu=gpu,
            switch=self.switch,
            attributes={name: value for name, value in attributes.items() if value is not None},
        )
