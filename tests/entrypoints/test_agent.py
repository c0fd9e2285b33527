"""The node agent: what it reports and when (in process, on NodeSnapshots), and the `medic agent`
process end to end against the NVML shim and a kernel-log file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from nvml_support import DRIVER_NOT_LOADED, GPU_IS_LOST, UNKNOWN, ShimState, build_shim, pci_bus_id, shim_env

from medic.ageing import TREND_PER_DAY
from medic.apps.agent import Agent, AgentOptions
from medic.apps.server.decode import decode
from medic.events import EventKind, FaultEvent
from medic.gpu_state import (
    EccCounts,
    GpuSnapshot,
    NodeSnapshot,
    NvmlXid,
    PcieLink,
    RowRemap,
    Unavailable,
)
from medic.intake import read_file
from medic.integrations.kernel_log import KernelLog
from medic.integrations.sinks import FileSink, HttpSink

NODE = "gpu-node-07"
XID_79 = "NVRM: Xid (PCI:{pci}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID_13 = (
    "NVRM: Xid (PCI:{pci}): 13, pid=4412, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0)"
)


# -- in process: the change rules (medic/detection.py), through the agent's reads and waits -----

# What `gpu()` below reads: the counters every event about one of its GPUs carries.
HEALTHY_COUNTERS = {
    "ecc_corrected": 0,
    "ecc_uncorrected": 0,
    "row_remap_corrected": 0,
    "row_remap_uncorrected": 0,
}


def gpu(index: int, **changes: Any) -> GpuSnapshot:
    healthy = GpuSnapshot(
        index,
        uuid=f"GPU-{index}",
        pci_bus_id=pci_bus_id(index),
        ecc=EccCounts(0, 0, 0, 0),
        row_remap=RowRemap(0, 0, False, False),
        temperature_c=60,
        clock_reasons=(),
        power_w=500.0,
        pcie=PcieLink(5, 5, 16, 16),
        nvlinks=dict.fromkeys(range(4), True),
    )
    return replace(healthy, **changes)


def node(*changed: GpuSnapshot, count: int = 8, xids: Sequence[NvmlXid] = ()) -> NodeSnapshot:
    gpus = {g.index: g for g in (gpu(i) for i in range(count))} | {g.index: g for g in changed}
    return NodeSnapshot("550.54.15", count, tuple(gpus[i] for i in sorted(gpus)), tuple(xids))


class Readings:
    """What NVML answers next; the agent's reader."""

    def __init__(self) -> None:
        self.next: NodeSnapshot | Unavailable = node()
        self.reads = 0

    def read(self) -> NodeSnapshot | Unavailable:
        self.reads += 1
        return self.next

    def close(self) -> None:
        pass


class Sink:
    def __init__(self) -> None:
        self.events: list[FaultEvent] = []

    def emit(self, events: Sequence[FaultEvent]) -> None:
        self.events += events


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Rig:
    def __init__(self, tmp_path: Path, **options: Any) -> None:
        self.nvml, self.sink, self.clock = Readings(), Sink(), Clock()
        self.kmsg = tmp_path / "kmsg"
        self.kmsg.touch()
        self.agent = Agent(
            AgentOptions(node=NODE, switch="leaf-3", interval_s=1.0, **options),
            self.sink,
            self.nvml,
            KernelLog(self.kmsg),
            clock=self.clock,
            sleep=self._sleep,
        )
        self.sleeps: list[float] = []
        self.late_lines: list[str] = []  # written to the kernel log while the agent waits for a line

    def _sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.clock.now += seconds
        self.write(*self.late_lines)
        self.late_lines = []

    def write(self, *kernel_lines: str) -> None:
        with self.kmsg.open("a") as f:
            f.writelines(f"[ 1234.5] {line}\n" for line in kernel_lines)

    def poll(
        self, snapshot: NodeSnapshot | Unavailable | None = None, *kernel_lines: str
    ) -> list[FaultEvent]:
        if snapshot is not None:
            self.nvml.next = snapshot
        self.write(*kernel_lines)
        self.clock.now += 1.0
        return self.agent.poll()


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def one(events: list[FaultEvent]) -> FaultEvent:
    assert len(events) == 1, events
    return events[0]


def test_a_healthy_node_reports_nothing(rig: Rig) -> None:
    assert rig.poll() == []
    assert rig.poll() == []
    assert rig.sink.events == []


def test_uncorrected_ecc_rising_is_reported_once(rig: Rig) -> None:
    rig.poll(node(gpu(2, ecc=EccCounts(3, 1, 30, 1))))  # errors from before the agent: history
    event = one(rig.poll(node(gpu(2, ecc=EccCounts(8, 3, 35, 3)))))
    assert (event.kind, event.node, event.gpu, event.switch, event.source) == (
        EventKind.ECC,
        NODE,
        2,
        "leaf-3",
        "agent",
    )
    assert event.attributes == {
        "dbe": 2,
        "sbe": 5,
        "counter": "volatile",
        "dbe_total": 3,
        "sbe_total": 8,
        "row_remap_pending": False,
        "row_remap_failure": False,
        "uuid": "GPU-2",
        "counters": {
            "ecc_corrected": 35,
            "ecc_uncorrected": 3,
            "row_remap_corrected": 0,
            "row_remap_uncorrected": 0,
        },
    }
    assert rig.poll() == rig.poll() == []  # nothing new (the last poll's snapshot is unchanged)
    assert rig.poll(node(gpu(2, ecc=EccCounts(9, 3, 36, 3)))) == []  # corrected errors alone: no event
    assert rig.poll(node(gpu(2, ecc=EccCounts(0, 0, 36, 3)))) == []  # a GPU reset clears volatile counts


def test_the_aggregate_counter_serves_where_the_volatile_one_is_unknown(rig: Rig) -> None:
    rig.poll(node(gpu(0, ecc=EccCounts(None, None, 10, 0))))
    event = one(rig.poll(node(gpu(0, ecc=EccCounts(None, None, 12, 1)))))
    assert (event.attributes["dbe"], event.attributes["sbe"], event.attributes["counter"]) == (
        1,
        2,
        "aggregate",
    )


def test_a_row_remap_failure_is_an_ecc_event(rig: Rig) -> None:
    rig.poll()
    event = one(rig.poll(node(gpu(5, row_remap=RowRemap(0, 1, False, True)))))
    assert (event.kind, event.gpu, event.attributes["dbe"], event.attributes["row_remap_failure"]) == (
        EventKind.ECC,
        5,
        0,
        True,
    )
    assert rig.poll() == []


def test_a_pending_row_remap_is_an_ecc_event_once(rig: Rig) -> None:
    rig.poll()
    event = one(rig.poll(node(gpu(3, row_remap=RowRemap(1, 0, True, False)))))
    assert (event.kind, event.gpu, event.attributes["dbe"]) == (EventKind.ECC, 3, 0)
    assert (event.attributes["row_remap_pending"], event.attributes["row_remap_failure"]) == (True, False)
    assert rig.poll() == []  # still pending: not news
    assert rig.poll(node()) == []  # a reset activated it
    assert one(rig.poll(node(gpu(3, row_remap=RowRemap(2, 0, True, False))))).kind is EventKind.ECC


def test_nvlink_error_counters_are_reported_once_they_rise_enough(rig: Rig) -> None:
    rig.poll(node(gpu(1, nvlink_errors={"replay": 100, "crc_flit": 5, "recovery": 0})))  # the baseline
    assert rig.poll(node(gpu(1, nvlink_errors={"replay": 104, "crc_flit": 7, "recovery": 0}))) == []  # +6
    event = one(rig.poll(node(gpu(1, nvlink_errors={"replay": 130, "crc_flit": 9, "recovery": 1}))))
    assert (event.kind, event.gpu, event.attributes["check"]) == (EventKind.HEALTH_CHECK, 1, "nvlink_errors")
    assert (event.attributes["nvlink_errors"], event.attributes["replay"], event.attributes["crc_flit"]) == (
        35,
        30,
        4,
    )
    assert event.attributes["recovery"] == 1
    assert rig.poll() == []  # counters cleared (a reset): a new baseline, not a fault
    assert rig.poll(node(gpu(1, nvlink_errors={"replay": 3}))) == []


def test_events_about_a_gpu_carry_its_counters_of_this_poll(rig: Rig) -> None:
    worn = gpu(
        4,
        ecc=EccCounts(0, 0, 120, 0),
        row_remap=RowRemap(3, 0, False, False),
        nvlink_errors={"replay": 9, "crc_flit": 40, "crc_data": 2},
    )
    rig.poll(node(worn))
    event = one(rig.poll(node(worn), XID_79.format(pci=pci_bus_id(4))))
    assert (event.kind, event.gpu) == (EventKind.XID, 4)
    assert event.attributes["counters"] == {
        "ecc_corrected": 120,
        "ecc_uncorrected": 0,
        "row_remap_corrected": 3,
        "row_remap_uncorrected": 0,
        "nvlink_crc": 42,
    }
    assert set(event.attributes["counters"]) <= set(TREND_PER_DAY)  # the names hardware ageing trends
    rig.agent.next_nvml_at = rig.clock.now + 60  # NVML backing off: this poll read no counters
    event = one(rig.poll(None, XID_13.format(pci=pci_bus_id(4))))
    assert event.gpu == 4 and "counters" not in event.attributes


def test_kernel_log_sxids_become_health_checks(rig: Rig) -> None:
    rig.poll()
    events = rig.poll(
        None,
        *["nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error"]
        * 3,
        "nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): 24007, Fatal, Link 30 sourcetrack timeout error",
    )
    assert [
        (e.kind, e.gpu, e.attributes["check"], e.attributes["sxid"], e.attributes["fatal"]) for e in events
    ] == [
        (EventKind.HEALTH_CHECK, None, "nvswitch_sxid", 12028, False),
        (EventKind.HEALTH_CHECK, None, "nvswitch_sxid", 24007, True),
    ]
    assert events[0].attributes["count"] == 3
    assert (
        events[1].attributes["nvswitch"],
        events[1].attributes["pci_bus_id"],
        events[1].attributes["link"],
    ) == (
        "nvswitch3",
        "0000:c1:00",
        30,
    )


def test_a_mig_xid_keeps_its_gpu_instance(rig: Rig) -> None:
    rig.poll()
    line = (
        f"NVRM: Xid (PCI:{pci_bus_id(2)} GPU-I:05 GPU-CI:01): 94, pid=7, name=python3, Contained: SM (0x1)."
    )
    event = one(rig.poll(None, line))
    assert (event.gpu, event.attributes["code"]) == (2, 94)
    assert (event.attributes["gpu_instance"], event.attributes["compute_instance"]) == (5, 1)


def test_thermal_throttling_is_reported_when_it_starts(rig: Rig) -> None:
    rig.poll(node(gpu(1, clock_reasons=("sw_power_cap",))))  # power capping is not thermal
    assert rig.sink.events == []
    hot = node(gpu(1, temperature_c=92, clock_reasons=("sw_power_cap", "hw_thermal_slowdown")))
    event = one(rig.poll(hot))
    assert (event.kind, event.gpu) == (EventKind.THERMAL, 1)
    assert event.attributes["temperature_c"] == 92
    assert event.attributes["throttle_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert rig.poll(hot) == []
    assert rig.poll(node()) == []
    assert one(rig.poll(hot)).kind is EventKind.THERMAL  # a new episode


def test_a_pcie_link_below_its_capability(rig: Rig) -> None:
    assert rig.poll(node(gpu(3, pcie=PcieLink(1, 5, 16, 16), clock_reasons=("gpu_idle",)))) == []
    narrow = node(gpu(3, pcie=PcieLink(5, 5, 8, 16)))
    event = one(rig.poll(narrow))
    assert (event.kind, event.gpu, event.attributes["check"], event.attributes["phase"]) == (
        EventKind.HEALTH_CHECK,
        3,
        "pcie_link",
        "healthcheck",
    )
    assert event.attributes["message"] == "PCIe link at Gen5 x8, capable of Gen5 x16"
    assert (event.attributes["pcie_width"], event.attributes["pcie_max_width"]) == (8, 16)
    assert rig.poll(narrow) == []
    slow_too = one(rig.poll(node(gpu(3, pcie=PcieLink(3, 5, 8, 16)))))  # busy at Gen3 as well
    assert slow_too.attributes["degraded"] == ["width", "gen"]


def test_an_nvlink_link_that_goes_down(rig: Rig) -> None:
    links = {0: True, 1: True, 2: True, 3: False}  # link 3 was never up: unused, not a fault
    rig.poll(node(gpu(6, nvlinks=links)))
    event = one(rig.poll(node(gpu(6, nvlinks=links | {1: False}))))
    assert (event.gpu, event.attributes["check"], event.attributes["links_down"]) == (6, "nvlink", [1])
    assert event.attributes["message"] == "NVLink link 1 down"
    assert rig.poll() == []


def test_fewer_gpus_than_expected(rig: Rig) -> None:
    rig.poll()
    event = one(rig.poll(node(gpu(3, lost=True))))
    assert (event.kind, event.gpu, event.attributes) == (
        EventKind.GPU_MISSING,
        3,
        {"expected": 8, "found": 7, "lost_gpus": [3]},
    )
    assert rig.poll() == []
    assert rig.poll(node(count=7)) == []  # gone from the bus now: still 7, nothing new
    assert one(rig.poll(node(count=6))).attributes == {"expected": 8, "found": 6, "lost_gpus": []}
    rig.poll(node())
    assert one(rig.poll(node(count=7))).kind is EventKind.GPU_MISSING  # back, then gone again


def test_expected_gpus_counts_from_the_first_read(tmp_path: Path) -> None:
    rig = Rig(tmp_path, expected_gpus=8)
    assert one(rig.poll(node(count=7))).attributes == {"expected": 8, "found": 7, "lost_gpus": []}


def test_kernel_log_xids_map_to_gpus_and_storms_become_one_event(rig: Rig) -> None:
    rig.poll()
    events = rig.poll(
        None,
        XID_79.format(pci=pci_bus_id(4)),
        *[XID_13.format(pci=pci_bus_id(2))] * 5,
        "nvidia-peermem: unrelated line",
        XID_79.format(pci="0000:99:00"),  # not a GPU NVML knows
    )
    assert [(e.kind, e.gpu, e.attributes["code"], e.attributes.get("count")) for e in events] == [
        (EventKind.XID, 4, 79, None),
        (EventKind.XID, 2, 13, 5),
        (EventKind.XID, None, 79, None),
    ]
    assert events[0].attributes == {
        "code": 79,
        "via": "kernel_log",
        "pci_bus_id": pci_bus_id(4),
        "message": "GPU has fallen off the bus.",
        "counters": HEALTHY_COUNTERS,
    }
    assert (events[1].attributes["pid"], events[1].attributes["process"]) == (4412, "python3")
    assert events[2].attributes["pci_bus_id"] == "0000:99:00"
    assert rig.poll() == []
    assert one(rig.poll(None, XID_79.format(pci=pci_bus_id(4)))).gpu == 4  # a second XID 79 is news


def test_one_xid_seen_by_the_kernel_log_and_nvml_is_reported_once(rig: Rig) -> None:
    rig.poll()
    both = rig.poll(node(xids=[NvmlXid(4, 79)]), XID_79.format(pci=pci_bus_id(4)))
    assert [(e.gpu, e.attributes["via"]) for e in both] == [(4, "kernel_log")]
    # NVML first, the kernel-log line a poll later: still one XID.
    nvml_first = rig.poll(node(xids=[NvmlXid(2, 48)]))
    assert [(e.gpu, e.attributes["code"], e.attributes["via"]) for e in nvml_first] == [(2, 48, "nvml")]
    assert nvml_first[0].attributes["pci_bus_id"] == pci_bus_id(2)
    assert rig.poll(node(), XID_79.format(pci=pci_bus_id(2)).replace(": 79,", ": 48,")) == []
    rig.clock.now += 61  # long after: a new XID
    assert one(rig.poll(node(xids=[NvmlXid(4, 79)]))).attributes["via"] == "nvml"


def test_an_xid_nvml_reports_first_waits_briefly_for_the_drivers_line(rig: Rig) -> None:
    """NVML's event can land a moment before the driver's kernel-log line: the event waits for the line
    (once, 0.2 s) and goes out with its message, pid and process, instead of bare."""
    rig.poll()
    rig.late_lines = [XID_13.format(pci=pci_bus_id(3))]
    event = one(rig.poll(node(xids=[NvmlXid(3, 13)])))
    assert rig.sleeps == [0.2]
    assert (event.gpu, event.attributes["via"], event.attributes["pid"], event.attributes["process"]) == (
        3,
        "kernel_log",
        4412,
        "python3",
    )
    assert event.attributes["message"].startswith("Graphics SM Warp Exception")
    # An XID whose line never comes waits once, then goes out bare.
    rig.clock.now += 61
    assert one(rig.poll(node(xids=[NvmlXid(5, 79)]))).attributes["via"] == "nvml"
    assert rig.sleeps == [0.2, 0.2]


def test_nvml_failing_is_reported_once_and_backed_off(rig: Rig) -> None:
    rig.poll()
    assert rig.nvml.reads == 1
    event = one(rig.poll(Unavailable("NVML: Unknown Error")))
    assert (event.kind, event.attributes["check"], event.attributes["message"]) == (
        EventKind.HEALTH_CHECK,
        "nvml",
        "NVML: Unknown Error",
    )
    reads = []
    for _ in range(12):  # a poll a second; NVML is tried 2, 4, then 8 s after each failure
        assert rig.poll() == []
        reads.append(rig.nvml.reads)
    assert reads == [2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4]
    rig.nvml.next = node()
    rig.clock.now += 16
    assert rig.poll() == []
    assert rig.nvml.reads == 5
    assert rig.poll() == [] and rig.nvml.reads == 6  # back to every poll


def test_a_host_that_never_had_nvml_is_no_fault(rig: Rig) -> None:
    assert rig.poll(Unavailable("NVML: NVML Shared Library Not Found")) == []
    # The kernel log is still read.
    assert one(rig.poll(None, XID_79.format(pci=pci_bus_id(0)))).gpu is None


# -- sinks ----------------------------------------------------------------------------------


def test_file_sink_appends_what_medic_ingest_reads(rig: Rig, tmp_path: Path) -> None:
    rig.poll()
    events = rig.poll(node(gpu(1, lost=True)), XID_79.format(pci=pci_bus_id(1)))
    sink = FileSink(tmp_path / "spool" / "events.jsonl")
    sink.emit(events[:1])
    sink.emit(events[1:])
    intake = read_file(sink.path)
    assert (intake.events, intake.rejected) == (events, [])


class Service:
    """A stand-in for GPU Medic's ingest endpoint: records requests, answers `statuses` in turn."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                service.requests.append((self.path, dict(self.headers), body))
                status = service.statuses.pop(0) if service.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self, request: int) -> list[FaultEvent]:
        return [FaultEvent.model_validate_json(line) for line in self.requests[request][2].splitlines()]


@pytest.fixture
def service() -> Iterator[Service]:
    service = Service([])
    yield service
    service.server.shutdown()
    service.server.server_close()


def test_http_sink_posts_json_lines_with_the_bearer_token(rig: Rig, service: Service) -> None:
    rig.poll()
    [xid] = rig.poll(None, XID_79.format(pci=pci_bus_id(1)))
    sink = HttpSink(service.url + "/", "s3cret")
    sink.emit([xid])
    [(path, headers, body)] = service.requests
    assert path == "/v1/events"
    assert headers["Authorization"] == "Bearer s3cret"
    assert headers["Content-Type"] == "application/x-ndjson"
    # What GPU Medic's ingest service makes of the body.
    decoded = decode(body, headers["Content-Type"], "127.0.0.1")
    assert (decoded.events, decoded.problems) == ([xid], [])


def test_http_sink_keeps_events_the_service_could_not_take(rig: Rig, service: Service) -> None:
    rig.poll()
    first = rig.poll(None, XID_79.format(pci=pci_bus_id(1)))
    second = rig.poll(node(gpu(1, lost=True)))
    service.statuses = [503, 401]
    sink = HttpSink(service.url, "s3cret")
    sink.emit(first)  # 503: kept
    sink.emit(second)  # 401: refused, sending again cannot help
    sink.emit([])
    assert [len(r[2].splitlines()) for r in service.requests] == [1, 2]
    assert service.events(1) == first + second
    assert sink.pending == type(sink.pending)()


# -- end to end: `medic agent` against the NVML shim ------------------------------------------

INTERVAL_S = 0.5
# An event must appear within one poll interval of the change; the slack covers a poll's own
# time and a busy 2-core machine running other tests at the same time.
SLACK_S = 1.0


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shim(tmp_path_factory.mktemp("nvml-shim"))


class AgentProcess:
    def __init__(self, shim: Path, tmp_path: Path, *args: str) -> None:
        self.state = ShimState(tmp_path / "nvml-state")
        self.kmsg = tmp_path / "kmsg"
        self.kmsg.touch()
        self.events_file = tmp_path / "events.jsonl"
        self.log = tmp_path / "agent.log"
        command = [
            sys.executable,
            "-m",
            "medic.apps.cli.agent",
            f"--interval={INTERVAL_S}",
            f"--kmsg={self.kmsg}",
            f"--sink={self.events_file}",
            f"--node={NODE}",
            *args,
        ]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(command, env=shim_env(shim, self.state), stderr=log)
        self.wait_for(lambda: "medic agent started" in self.log.read_text(), "the agent to start")

    def nvml_read(self) -> bool:
        return "NVML answers: 8 GPUs, driver 550.54.15" in self.log.read_text()

    def events(self) -> list[FaultEvent]:
        if not self.events_file.exists():
            return []
        return [FaultEvent.model_validate_json(line) for line in self.events_file.read_text().splitlines()]

    def wait_for(self, check: Callable[[], bool], what: str, within_s: float = 15.0) -> float:
        started = time.monotonic()
        while not check():
            assert self.process.poll() is None, f"the agent exited:\n{self.log.read_text()}"
            if time.monotonic() - started > within_s:
                raise AssertionError(f"no {what} within {within_s} s:\n{self.log.read_text()}")
            time.sleep(0.02)
        return time.monotonic() - started

    def wait_events(self, count: int) -> float:
        """Seconds until the events file holds `count` events."""
        return self.wait_for(lambda: len(self.events()) >= count, f"{count} events")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=10)


@pytest.fixture
def agent(shim: Path, tmp_path: Path) -> Iterator[AgentProcess]:
    process = AgentProcess(shim, tmp_path)
    yield process
    if process.process.poll() is None:
        process.process.kill()
        process.process.wait()


def test_xid_and_ecc_jump_become_events_within_one_interval(agent: AgentProcess) -> None:
    agent.wait_for(agent.nvml_read, "a first NVML read")
    time.sleep(2 * INTERVAL_S)
    assert agent.events() == []  # a healthy node: nothing, however many polls

    with agent.kmsg.open("a") as f:
        f.write(XID_79.format(pci=pci_bus_id(3)) + "\n")
    took = agent.wait_events(1)
    assert took < INTERVAL_S + SLACK_S
    [xid] = agent.events()
    assert (xid.kind, xid.gpu, xid.node, xid.attributes["code"]) == (EventKind.XID, 3, NODE, 79)

    agent.state.gpu(5, dbe_volatile=2, sbe_volatile=3)
    took = agent.wait_events(2)
    assert took < INTERVAL_S + SLACK_S
    ecc = agent.events()[1]
    assert (ecc.kind, ecc.gpu, ecc.attributes["dbe"], ecc.attributes["sbe"]) == (EventKind.ECC, 5, 2, 3)

    time.sleep(2 * INTERVAL_S)
    assert len(agent.events()) == 2  # nothing changed since: nothing more
    assert agent.stop() == 0
    assert "medic agent stopped" in agent.log.read_text()


def test_an_nvml_xid_becomes_an_event(agent: AgentProcess) -> None:
    agent.state.xid(6, 48)
    agent.wait_events(1)
    [xid] = agent.events()
    assert (xid.gpu, xid.attributes) == (
        6,
        {"code": 48, "via": "nvml", "pci_bus_id": pci_bus_id(6), "counters": HEALTHY_COUNTERS},
    )


def test_a_lost_gpu_is_a_gpu_missing_event(agent: AgentProcess) -> None:
    agent.state.gpu(4, lost=1)
    agent.wait_events(1)
    [missing] = agent.events()
    assert (missing.kind, missing.gpu, missing.attributes) == (
        EventKind.GPU_MISSING,
        4,
        {"expected": 8, "found": 7, "lost_gpus": [4]},
    )
    agent.state.fail("nvmlDeviceGetPowerUsage", GPU_IS_LOST, gpu=4)  # still lost, another way
    time.sleep(2 * INTERVAL_S)
    assert len(agent.events()) == 1


def test_the_agent_survives_nvml_failing_and_recovers(shim: Path, tmp_path: Path) -> None:
    agent = AgentProcess(shim, tmp_path, "--max-backoff=1")
    try:
        agent.wait_for(agent.nvml_read, "a first NVML read")
        agent.state.set(init_rc=DRIVER_NOT_LOADED, call_rc=UNKNOWN)  # the driver goes away
        agent.wait_events(1)
        [failed] = agent.events()
        assert (failed.kind, failed.attributes["check"]) == (EventKind.HEALTH_CHECK, "nvml")
        agent.wait_for(lambda: "Driver Not Loaded" in agent.log.read_text(), "a failed re-init")

        # The kernel log is still read while NVML is down.
        with agent.kmsg.open("a") as f:
            f.write(XID_79.format(pci=pci_bus_id(0)) + "\n")
        agent.wait_events(2)

        agent.state.set(init_rc=0, call_rc=0)  # back
        agent.wait_for(lambda: "NVML answers after" in agent.log.read_text(), "NVML to recover")
        agent.state.gpu(1, dbe_volatile=1)
        agent.wait_events(3)
        assert [e.kind for e in agent.events()] == [EventKind.HEALTH_CHECK, EventKind.XID, EventKind.ECC]
        assert agent.process.poll() is None
    finally:
        assert agent.stop() == 0


def test_once_polls_and_exits(shim: Path, tmp_path: Path) -> None:
    state = ShimState(tmp_path / "state")
    state.gpu(2, reasons=0x40, temp=91)
    done = subprocess.run(
        [sys.executable, "-m", "medic.apps.cli.agent", "--once", "--no-kmsg", "--sink=-", "--node", NODE],
        env=shim_env(shim, state),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    [event] = [FaultEvent.model_validate_json(line) for line in done.stdout.splitlines()]
    assert (event.kind, event.gpu, event.attributes["temperature_c"]) == (EventKind.THERMAL, 2, 91)


def test_an_http_sink_needs_a_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MEDIC_TOKEN"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "medic.apps.cli.agent",
            "--once",
            "--sink=http://127.0.0.1:9",
            "--no-nvml",
            "--no-kmsg",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "needs a bearer token in $MEDIC_TOKEN" in done.stderr
