"""`InstanceProbe`, `AllReduceTest` and `NicLoopbackTest` over the simulated fleet: each node's
`SimHardware` as NVML, an all-reduce, ib_write_bw and ib_write_lat would show it. A node that is not in the fleet gets an error, never a reading."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from medic.integrations.sim.fleet import SimFleet, SimHardware, UnknownSimNodeError
from medic.protocols import (
    AllReduceRun,
    AllReduceSpec,
    GpuReading,
    InstanceReading,
    NicLatencyRun,
    NicLoopbackRun,
)

SIM_GPU = "NVIDIA H100 80GB HBM3"


def _gpus(hw: SimHardware) -> tuple[GpuReading, ...]:
    readings = []
    for index in range(hw.gpus - hw.missing):
        if index in hw.lost:
            readings.append(GpuReading(index, SIM_GPU, lost=True))
            continue
        down = tuple(link for gpu, link in hw.links_down if gpu == index)
        up = tuple(link for link in range(hw.nvlinks) if link not in down)
        readings.append(GpuReading(index, SIM_GPU, links_up=up, links_down=down))
    return tuple(readings)


class SimInstanceProbe:
    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    def read(self, node: str, timeout_s: float) -> InstanceReading:
        started = datetime.now(UTC)
        with self.fleet.lock:
            if not self.fleet.has_node(node):
                why = str(UnknownSimNodeError(node, list(self.fleet.nodes)))
                return InstanceReading(node, error=why, started_at=started, finished_at=datetime.now(UTC))
            self.fleet.record_call(node, "nvml")
            hw = self.fleet.hardware_of(node)
        gpus = _gpus(hw)
        output = json.dumps(
            {
                "simulated": "NVML",
                "gpu_count": len(gpus),
                "gpus": [{"index": g.index, "lost": g.lost, "links_down": g.links_down} for g in gpus],
            }
        )
        return InstanceReading(
            node, len(gpus), gpus, output=output, started_at=started, finished_at=datetime.now(UTC)
        )


class SimAllReduce:
    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    def run(self, spec: AllReduceSpec, timeout_s: float) -> AllReduceRun:
        started = datetime.now(UTC)
        command = ("simulated", "all_reduce_perf", "-b", str(spec.min_bytes), "-e", str(spec.max_bytes))

        def failed(why: str) -> AllReduceRun:
            return AllReduceRun(spec, command, error=why, started_at=started, finished_at=datetime.now(UTC))

        with self.fleet.lock:
            unknown = [n for n in spec.nodes if not self.fleet.has_node(n)]
            if unknown:
                return failed(str(UnknownSimNodeError(unknown[0], list(self.fleet.nodes))))
            for node in spec.nodes:
                self.fleet.record_call(node, "all_reduce")
            hardware = {node: self.fleet.hardware_of(node) for node in spec.nodes}
        short = [n for n, hw in hardware.items() if hw.gpus - hw.missing - len(hw.lost) < spec.gpus_per_node]
        if short:
            # What all_reduce_perf does when a rank finds no GPU: it fails before its first result.
            return failed(f"simulated all_reduce_perf: Test CUDA failure on {', '.join(short)}: no such GPU")
        one = len(spec.nodes) == 1
        busbw = min(hw.busbw_gbps if one else hw.fabric_busbw_gbps for hw in hardware.values())
        wrong = [n for n, hw in hardware.items() if hw.wrong_results]
        output = (
            f"simulated all_reduce_perf on {', '.join(spec.nodes)}: {spec.gpus_per_node} ranks each, "
            f"busbw {busbw:g} GB/s at {spec.max_bytes} B"
            + (f"; wrong results from {', '.join(wrong)}" if wrong else "")
        )
        return AllReduceRun(
            spec,
            command,
            ranks=len(spec.nodes) * spec.gpus_per_node,
            hosts=spec.nodes,
            largest_bytes=spec.max_bytes,
            busbw_gbps=busbw,
            avg_busbw_gbps=round(busbw * 0.4, 2),  # small sizes pull nccl-tests' average down
            out_of_bounds=1 if wrong else 0,
            wrong=(f"{spec.max_bytes} B out-of-place: 96",) if wrong else (),
            output=output,
            started_at=started,
            finished_at=datetime.now(UTC),
        )


class SimNicLoopback:
    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    def run(
        self, node: str, device: str, size_bytes: int, duration_s: int, timeout_s: float
    ) -> NicLoopbackRun:
        started = datetime.now(UTC)
        command = ("simulated", "ib_write_bw", "-d", device, "-s", str(size_bytes), "localhost")
        hardware, why = self._hardware(node, "nic_loopback")
        if hardware is None:
            return NicLoopbackRun(
                node, device, command, error=why, started_at=started, finished_at=datetime.now(UTC)
            )
        gbps = hardware.nic_gbps
        return NicLoopbackRun(
            node,
            device,
            command,
            size_bytes=size_bytes,
            bw_avg_gbps=gbps,
            bw_peak_gbps=gbps,
            msg_rate_mpps=round(gbps * 1e9 / 8 / size_bytes / 1e6, 6),
            output=f"simulated ib_write_bw loopback on {node} {device}: {gbps:g} Gb/s at {size_bytes} B",
            started_at=started,
            finished_at=datetime.now(UTC),
        )

    def latency(self, node: str, device: str, iterations: int, timeout_s: float) -> NicLatencyRun:
        started = datetime.now(UTC)
        command = ("simulated", "ib_write_lat", "-d", device, "-n", str(iterations), "localhost")
        hardware, why = self._hardware(node, "nic_latency")
        if hardware is None:
            return NicLatencyRun(
                node, device, command, error=why, started_at=started, finished_at=datetime.now(UTC)
            )
        typical = hardware.nic_lat_us
        return NicLatencyRun(
            node,
            device,
            command,
            size_bytes=2,
            iterations=iterations,
            typical_us=typical,
            p99_us=typical,
            p999_us=typical,
            output=f"simulated ib_write_lat loopback on {node} {device}: {typical:g} usec typical",
            started_at=started,
            finished_at=datetime.now(UTC),
        )

    def _hardware(self, node: str, call: str) -> tuple[SimHardware | None, str]:
        """The node's hardware, the call recorded; for a node not in the fleet, None and why."""
        with self.fleet.lock:
            if not self.fleet.has_node(node):
                return None, str(UnknownSimNodeError(node, list(self.fleet.nodes)))
            self.fleet.record_call(node, call)
            return self.fleet.hardware_of(node), ""
