"""The node agent (`medic agent`, docs/agent.md): watch this node's GPUs and report faults once.

Every poll reads NVML (medic/integrations/nvml.py) and the new kernel-log lines and hands them to the
domain's `FaultDetector` (medic/detection.py), which decides what changed and is news: a new XID,
uncorrected ECC errors rising, a GPU gone, a degraded link, throttling, an NVSwitch SXid, NVML
itself failing. This module does the I/O around it: reading, waiting, backing off, sending.
NVML errors never stop it: it backs off and opens NVML again on a later poll.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from medic.detection import DEFAULT_NVLINK_ERROR_MIN_RISE, FaultDetector
from medic.events import FaultEvent
from medic.gpu_state import KernelSxid, KernelXid, NodeSnapshot, Unavailable
from medic.integrations.kernel_log import KernelLog, parse_sxid, parse_xid
from medic.integrations.sinks import EventSink

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 15.0
DEFAULT_MAX_BACKOFF_S = 300.0
# An XID NVML reports whose kernel-log line is not there yet waits this long for it once, so that its
# event carries the driver's message, pid and process rather than go out bare and drop the line later.
KERNEL_LINE_GRACE_S = 0.2


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
        self.detector = FaultDetector(
            options.node,
            switch=options.switch,
            expected_gpus=options.expected_gpus,
            nvlink_error_min_rise=options.nvlink_error_min_rise,
        )
        self.nvml_failures = 0
        self.next_nvml_at = 0.0
        self.last_problem: str | None = None

    # -- one poll ---------------------------------------------------------------------------

    def poll(self) -> list[FaultEvent]:
        """Look once, emit what changed, and return it."""
        snapshot = self._read_nvml()
        # After NVML: the driver writes an XID's kernel-log line as it posts the NVML event.
        kernel_xids, kernel_sxids = self._kernel_lines()
        if (
            isinstance(snapshot, NodeSnapshot)
            and self.kernel_log is not None
            and self.detector.awaits_kernel_line(snapshot, kernel_xids)
        ):
            self.sleep(KERNEL_LINE_GRACE_S)
            late_xids, late_sxids = self._kernel_lines()
            kernel_xids += late_xids
            kernel_sxids += late_sxids
        events = self.detector.observe(
            snapshot, kernel_xids, kernel_sxids, clock_s=self.clock(), time=datetime.now(UTC)
        )
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

    # -- reading ----------------------------------------------------------------------------

    def _read_nvml(self) -> NodeSnapshot | Unavailable | None:
        """This poll's NVML read: None when there is no NVML or it is backing off after failures."""
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
        # The detector has seen the reads before this one: NVML answering again is logged once.
        if self.detector.nvml_ok is not True:
            after = f" after {self.nvml_failures} failed reads" if self.nvml_failures else ""
            log.info("NVML answers%s: %d GPUs, driver %s", after, snapshot.gpu_count, snapshot.driver_version)
        self.nvml_failures, self.next_nvml_at, self.last_problem = 0, 0.0, None
        return snapshot

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
