"""medic/detection.py alone: the agent's fault rules on values, with no NVML, kernel log, sink or
clock but the one given. What each rule reports is tested through the agent
(tests/entrypoints/test_agent.py); here, what the detector takes from its caller."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from medic.detection import XID_MATCH_WINDOW_S, FaultDetector
from medic.events import EventKind
from medic.gpu_state import EccCounts, GpuSnapshot, KernelXid, NodeSnapshot, NvmlXid

T0 = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
PCI = "0000:3b:00"


def node(*, dbe: int = 0, xids: tuple[NvmlXid, ...] = ()) -> NodeSnapshot:
    gpu = GpuSnapshot(0, uuid="GPU-0", pci_bus_id=PCI, ecc=EccCounts(0, dbe, 10, dbe))
    return NodeSnapshot("550.54.15", 1, (gpu,), xids)


def line(code: int = 79) -> KernelXid:
    return KernelXid(PCI, code, "GPU has fallen off the bus.")


def test_events_take_the_time_given_and_say_who_reported_them() -> None:
    detector = FaultDetector("gpu-node-07", switch="leaf-3")
    assert detector.observe(node(), clock_s=0.0, time=T0) == []
    later = T0 + timedelta(hours=1)
    [event] = detector.observe(node(dbe=2), clock_s=1.0, time=later)
    assert (event.kind, event.time, event.source, event.node, event.switch, event.gpu) == (
        EventKind.ECC,
        later,
        "agent",
        "gpu-node-07",
        "leaf-3",
        0,
    )
    assert re.fullmatch(r"agent-[0-9a-f]{32}", event.id)


def test_the_xid_window_runs_on_the_clock_given_not_on_the_events_time() -> None:
    reported_by_nvml = node(xids=(NvmlXid(0, 79),))
    # The wall clock stepped a day (NTP) between the two sightings; the monotonic clock says a
    # second: the same XID.
    stepped = FaultDetector("n")
    stepped.observe(node(), clock_s=0.0, time=T0)
    [first] = stepped.observe(node(), [line()], clock_s=1.0, time=T0)
    assert first.attributes["via"] == "kernel_log"
    assert stepped.observe(reported_by_nvml, clock_s=2.0, time=T0 + timedelta(days=1)) == []
    # The monotonic clock past the window, the wall clock still: a new XID.
    later = FaultDetector("n")
    later.observe(node(), clock_s=0.0, time=T0)
    later.observe(node(), [line()], clock_s=1.0, time=T0)
    [again] = later.observe(reported_by_nvml, clock_s=2.0 + XID_MATCH_WINDOW_S, time=T0)
    assert (again.gpu, again.attributes["via"], again.attributes["pci_bus_id"]) == (0, "nvml", PCI)


def test_an_nvml_xid_awaits_its_kernel_line_unless_it_was_seen() -> None:
    detector = FaultDetector("n")
    detector.observe(node(), clock_s=0.0, time=T0)
    reported = node(xids=(NvmlXid(0, 79),))
    assert detector.awaits_kernel_line(reported, [])
    assert not detector.awaits_kernel_line(reported, [line()])  # the line came in this poll
    assert not detector.awaits_kernel_line(node(), [])  # NVML reported nothing
    detector.observe(None, [line()], clock_s=1.0, time=T0)
    assert not detector.awaits_kernel_line(reported, [])  # the line came a poll earlier
