"""perftest's ib_write_bw and ib_write_lat in loopback (medic/integrations/nic_loopback.py): their real
output read from the runs people posted (tests/fixtures/perftest/SOURCES.md), the commands run for real
on this machine against stand-in tools, and the `nic_loopback` check judged against the shape's floor
and latency ceiling."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from checkout import TEST_FIXTURES

from medic.deep_check import Verdict, judge_nic_loopback, overall
from medic.integrations.dcgm.runner import Completed, LocalRunner
from medic.integrations.nic_loopback import (
    MISSING,
    IbWriteBwLoopback,
    PerftestOutputError,
    missing,
    parse_latency,
    parse_output,
)
from medic.policy.deep_checks import DeepChecks, Shape
from medic.protocols import NicLatencyRun, NicLoopbackRun, NicLoopbackTest

FIXTURES = TEST_FIXTURES / "perftest"
LOOPBACK = (FIXTURES / "loopback_ib0_8M_mbsec.txt").read_text()
ROCE = (FIXTURES / "roce_8B_60s_gbsec.txt").read_text()
LAT_ALL_SIZES = (FIXTURES / "lat_ib_mlx4_all_sizes.txt").read_text()
LAT_ROCE = (FIXTURES / "lat_roce_rdma_cm_2B.txt").read_text()
NODE = "gpu-node-1"
SHAPE = Shape(gpus=8, busbw_floor_gbps=400, rdma_devices=("mlx5_0", "mlx5_1"), nic_bw_floor_gbps=190)


class Scripted:
    """A runner that answers every command with one `Completed`, and keeps what it was asked."""

    def __init__(self, done: Completed) -> None:
        self.done = done
        self.asked: list[tuple[str, tuple[str, ...], float]] = []

    def run(self, node: str, argv: Sequence[str], timeout_s: float) -> Completed:
        self.asked.append((node, tuple(argv), timeout_s))
        return self.done


def completed(stdout: str, returncode: int | None = 0, timed_out: bool = False) -> Completed:
    return Completed(("sh", "-c", "…"), stdout, "", returncode, timed_out=timed_out)


def measured(device: str, gbps: float) -> NicLoopbackRun:
    return NicLoopbackRun(
        NODE, device, ("ib_write_bw",), size_bytes=8388608, bw_avg_gbps=gbps, bw_peak_gbps=gbps
    )


def timed(device: str, typical_us: float) -> NicLatencyRun:
    return NicLatencyRun(
        NODE, device, ("ib_write_lat",), size_bytes=2, iterations=1000, typical_us=typical_us
    )


def test_every_fixture_is_read() -> None:
    assert sorted(p.name for p in FIXTURES.glob("*.txt")) == [
        "lat_ib_mlx4_all_sizes.txt",
        "lat_roce_rdma_cm_2B.txt",
        "loopback_ib0_8M_mbsec.txt",
        "roce_8B_60s_gbsec.txt",
    ]


def test_a_loopback_in_mb_per_second_is_read_in_gbits_from_the_clients_table() -> None:
    report = parse_output(LOOPBACK)
    assert report.unit == "MB"
    assert len(report.rows) == 1  # the client's table; the server's, after it, is the same run
    row = report.largest
    assert (row.size_bytes, row.iterations, row.msg_rate_mpps) == (8388608, 20000, 0.003007)
    assert row.bw_avg_gbps == pytest.approx(24056.72 * 2**20 * 8 / 1e9, abs=1e-3)  # HDR's 200 Gb/s
    assert row.bw_peak_gbps == pytest.approx(201.803, abs=1e-3)


def test_a_run_in_gbits_with_no_peak_is_read_as_printed() -> None:
    report = parse_output(ROCE)
    assert report.unit == "Gb"
    row = report.largest
    assert (row.size_bytes, row.iterations, row.bw_peak_gbps, row.bw_avg_gbps, row.msg_rate_mpps) == (
        8,
        224958464,
        0.0,
        0.48,
        7.498617,
    )


def test_output_without_a_result_is_refused() -> None:
    lines = LOOPBACK.splitlines()
    header = next(i for i, line in enumerate(lines) if "#bytes" in line)
    with pytest.raises(PerftestOutputError, match="no result table"):
        parse_output("\n".join(lines[:header]))
    with pytest.raises(PerftestOutputError, match="no result under its header"):
        parse_output("\n".join(lines[: header + 1]))


def test_the_run_reads_its_table_and_keeps_the_output() -> None:
    runner = Scripted(completed(LOOPBACK))
    run = IbWriteBwLoopback(runner).run(NODE, "mlx5_0", 8388608, 5, 120)
    assert (run.error, run.missing_tool, run.size_bytes) == (None, None, 8388608)
    assert run.bw_avg_gbps == pytest.approx(201.802, abs=1e-3)
    assert run.output == LOOPBACK
    [(node, argv, timeout)] = runner.asked
    assert (node, argv[:2], argv[3:], timeout) == (NODE, ("sh", "-c"), ("sh", "mlx5_0", "8388608", "5"), 120)


def test_without_ib_write_bw_the_check_is_skipped_never_passed() -> None:
    run = IbWriteBwLoopback(Scripted(completed(MISSING + "\n", 127))).run(NODE, "mlx5_0", 8388608, 5, 120)
    assert (run.missing_tool, run.bw_avg_gbps) == ("ib_write_bw", None)
    result = judge_nic_loopback(NODE, [run, run], "h100-8", SHAPE)
    assert (result.verdict, result.reason) == (
        Verdict.SKIPPED,
        "not run: ib_write_bw not installed on gpu-node-1",
    )
    assert overall([result]) is Verdict.ERROR


def test_a_run_past_its_time_is_no_verdict() -> None:
    run = IbWriteBwLoopback(Scripted(completed("", None, timed_out=True))).run(NODE, "mlx5_0", 8388608, 5, 30)
    assert run.error == "ib_write_bw loopback on mlx5_0 did not finish within 30 s"
    result = judge_nic_loopback(NODE, [run, measured("mlx5_1", 390)], "h100-8", SHAPE)
    assert result.verdict is Verdict.ERROR
    assert result.reason == "mlx5_0: ib_write_bw loopback on mlx5_0 did not finish within 30 s"


def test_a_client_that_fails_without_a_table_is_no_verdict() -> None:
    done = completed(" Couldn't connect to localhost:18515\n", 1)
    run = IbWriteBwLoopback(Scripted(done)).run(NODE, "mlx5_0", 8388608, 5, 120)
    assert run.error is not None and run.error.startswith(
        "ib_write_bw loopback on mlx5_0: output unusable (exited 1)"
    )


def test_a_device_name_that_is_no_device_is_never_sent() -> None:
    runner = Scripted(completed(LOOPBACK))
    run = IbWriteBwLoopback(runner).run(NODE, "mlx5_0; reboot", 8388608, 5, 120)
    assert run.error is not None and not runner.asked


def test_each_device_is_judged_against_the_shapes_floor() -> None:
    ok = judge_nic_loopback(NODE, [measured("mlx5_0", 201.8), measured("mlx5_1", 195)], "h100-8", SHAPE)
    assert (ok.verdict, ok.reason) == (Verdict.PASS, "mlx5_0 201.8 Gb/s, mlx5_1 195 Gb/s; floor 190 Gb/s")
    slow = judge_nic_loopback(NODE, [measured("mlx5_0", 201.8), measured("mlx5_1", 96.5)], "h100-8", SHAPE)
    assert (slow.verdict, slow.reason) == (
        Verdict.FAIL,
        "mlx5_1 96.5 Gb/s, under the floor of 190 Gb/s of shape h100-8",
    )
    assert slow.measured["bw_avg_gbps"] == {"mlx5_0": 201.8, "mlx5_1": 96.5}


def test_without_a_floor_the_bandwidth_is_reported_not_judged() -> None:
    shape = SHAPE.model_copy(update={"nic_bw_floor_gbps": None, "rdma_devices": ("mlx5_0",)})
    result = judge_nic_loopback(NODE, [measured("mlx5_0", 12.5)], "h100-8", shape)
    assert (result.verdict, result.reason) == (Verdict.PASS, "mlx5_0 12.5 Gb/s; no floor in shape h100-8")
    unmeasured = judge_nic_loopback(NODE, [measured("mlx5_0", 12.5)], "h100-8", SHAPE)
    assert (unmeasured.verdict, unmeasured.reason) == (Verdict.ERROR, "mlx5_1: not measured")
    bare = Shape(gpus=8, busbw_floor_gbps=400)
    result = judge_nic_loopback(NODE, [], "l40s", bare)
    assert (result.verdict, result.reason) == (Verdict.PASS, "shape l40s has no RDMA device to check")


def test_the_policy_reads_devices_floors_and_the_run_and_refuses_a_bad_device() -> None:
    deep = DeepChecks.model_validate(
        {
            "shapes": {
                "h100-8": {
                    "gpus": 8,
                    "busbw_floor_gbps": 400,
                    "rdma_devices": ["mlx5_0"],
                    "nic_bw_floor_gbps": 380,
                }
            },
            "nic_loopback": {"duration_seconds": 10, "timeout_seconds": 60},
        }
    )
    assert deep.shapes["h100-8"].rdma_devices == ("mlx5_0",)
    assert (deep.nic_loopback.size_bytes, deep.nic_loopback.duration_seconds) == (8388608, 10)
    with pytest.raises(ValueError, match="rdma_devices"):
        Shape.model_validate({"gpus": 8, "busbw_floor_gbps": 400, "rdma_devices": ["mlx5_0 -x"]})


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on PATH for a stand-in ib_write_bw; the system's own directories for sh and sleep."""
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    return tmp_path


def test_the_script_starts_a_server_and_reads_the_clients_table(stand_in: Path) -> None:
    tool = stand_in / "ib_write_bw"
    # The server (no host argument) says it waits; the client (localhost last) prints the real run.
    tool.write_text(
        f'#!/bin/sh\nfor last; do :; done\nif [ "$last" = localhost ]; then cat {FIXTURES / "roce_8B_60s_gbsec.txt"}; '
        f'else echo "$*" > {stand_in / "server"}; fi\n'
    )
    tool.chmod(0o755)
    run = IbWriteBwLoopback(LocalRunner(aliases=[NODE])).run(NODE, "mlx5_0", 65536, 1, 30)
    assert (run.error, run.bw_avg_gbps) == (None, 0.48)
    assert (stand_in / "server").read_text() == "-d mlx5_0 -s 65536 -D 1 -F --report_gbits\n"


def test_the_script_says_when_ib_write_bw_is_not_on_the_node(stand_in: Path) -> None:
    assert not any((Path(d) / "ib_write_bw").exists() for d in os.environ["PATH"].split(":"))
    run = IbWriteBwLoopback(LocalRunner(aliases=[NODE])).run(NODE, "mlx5_0", 65536, 1, 30)
    assert (run.missing_tool, run.error) == ("ib_write_bw", None)


def test_a_latency_table_of_every_size_is_read_by_its_columns() -> None:
    report = parse_latency(LAT_ALL_SIZES)
    assert report.columns[-2:] == ["99% percentile[usec]", "99.9% percentile[usec]"]
    assert [r.size_bytes for r in report.rows] == [2**n for n in range(1, 24)]
    first, last = report.rows[0], report.rows[-1]
    assert (first.iterations, first.min_us, first.max_us, first.typical_us) == (20000, 0.88, 6.84, 0.98)
    assert (first.avg_us, first.stdev_us, first.p99_us, first.p999_us) == (1.03, 0.2, 1.21, 5.42)
    assert (last.size_bytes, last.typical_us, last.p999_us) == (8388608, 2302.01, 2335.48)
    assert report.smallest == first


def test_a_latency_run_over_rdma_cm_is_read_as_printed() -> None:
    row = parse_latency(LAT_ROCE).smallest
    assert (row.size_bytes, row.iterations, row.typical_us, row.p99_us, row.p999_us) == (
        2,
        1000,
        1.47,
        1.57,
        1.93,
    )


def test_latency_output_without_a_result_is_refused() -> None:
    lines = LAT_ROCE.splitlines()
    header = next(i for i, line in enumerate(lines) if "#bytes" in line)
    with pytest.raises(PerftestOutputError, match="no latency table"):
        parse_latency("\n".join(lines[:header]))
    with pytest.raises(PerftestOutputError, match="no result under its header"):
        parse_latency("\n".join(lines[: header + 1]))
    with pytest.raises(PerftestOutputError, match="no latency table"):
        parse_latency(LOOPBACK)  # a bandwidth table is no latency


def test_the_latency_run_reads_its_table_and_keeps_the_output() -> None:
    runner = Scripted(completed(LAT_ROCE))
    backend = IbWriteBwLoopback(runner)
    assert isinstance(backend, NicLoopbackTest)
    run = backend.latency(NODE, "mlx5_0", 1000, 120)
    assert (run.error, run.missing_tool, run.size_bytes, run.iterations) == (None, None, 2, 1000)
    assert (run.typical_us, run.p99_us, run.p999_us, run.output) == (1.47, 1.57, 1.93, LAT_ROCE)
    [(node, argv, timeout)] = runner.asked
    assert (node, argv[:2], argv[3:], timeout) == (NODE, ("sh", "-c"), ("sh", "mlx5_0", "1000"), 120)


def test_without_ib_write_lat_the_check_is_skipped_never_passed() -> None:
    done = completed(missing("ib_write_lat") + "\n", 127)
    lat = IbWriteBwLoopback(Scripted(done)).latency(NODE, "mlx5_0", 1000, 120)
    assert (lat.missing_tool, lat.typical_us) == ("ib_write_lat", None)
    runs = [measured("mlx5_0", 201.8), measured("mlx5_1", 195)]
    result = judge_nic_loopback(NODE, runs, "h100-8", SHAPE, [lat, lat])
    assert (result.verdict, result.reason) == (
        Verdict.SKIPPED,
        "not run: ib_write_lat not installed on gpu-node-1",
    )


def test_each_device_is_judged_against_the_shapes_latency_ceiling() -> None:
    shape = SHAPE.model_copy(update={"nic_lat_ceiling_us": 3})
    runs = [measured("mlx5_0", 201.8), measured("mlx5_1", 195)]
    ok = judge_nic_loopback(NODE, runs, "h100-8", shape, [timed("mlx5_0", 1.47), timed("mlx5_1", 2.9)])
    assert (ok.verdict, ok.reason) == (
        Verdict.PASS,
        "mlx5_0 201.8 Gb/s, mlx5_1 195 Gb/s; floor 190 Gb/s; mlx5_0 1.47 µs, mlx5_1 2.9 µs typical latency; "
        "ceiling 3 µs",
    )
    assert ok.measured["lat_typical_us"] == {"mlx5_0": 1.47, "mlx5_1": 2.9}
    assert "== mlx5_1 latency ==" in ok.output
    slow = judge_nic_loopback(NODE, runs, "h100-8", shape, [timed("mlx5_0", 1.47), timed("mlx5_1", 7.1)])
    assert (slow.verdict, slow.reason) == (
        Verdict.FAIL,
        "mlx5_1 7.1 µs typical latency, over the ceiling of 3 µs of shape h100-8",
    )


def test_without_a_ceiling_the_latency_is_reported_not_judged() -> None:
    runs = [measured("mlx5_0", 201.8), measured("mlx5_1", 195)]
    result = judge_nic_loopback(NODE, runs, "h100-8", SHAPE, [timed("mlx5_0", 9.5), timed("mlx5_1", 9.6)])
    assert result.verdict is Verdict.PASS
    assert result.reason.endswith("mlx5_0 9.5 µs, mlx5_1 9.6 µs typical latency; no ceiling in shape h100-8")
    half = judge_nic_loopback(NODE, runs, "h100-8", SHAPE, [timed("mlx5_0", 9.5)])
    assert (half.verdict, half.reason) == (Verdict.ERROR, "mlx5_1 latency: not measured")


def test_a_ceiling_with_no_latency_measured_is_no_verdict() -> None:
    """Bandwidth alone cannot pass a shape that sets a latency ceiling."""
    shape = SHAPE.model_copy(update={"nic_lat_ceiling_us": 3})
    runs = [measured("mlx5_0", 201.8), measured("mlx5_1", 195)]
    result = judge_nic_loopback(NODE, runs, "h100-8", shape)
    assert (result.verdict, result.reason) == (
        Verdict.ERROR,
        "latency not measured on gpu-node-1",
    )
    timed_out = NicLatencyRun(
        NODE, "mlx5_1", error="ib_write_lat loopback on mlx5_1 did not finish within 30 s"
    )
    result = judge_nic_loopback(NODE, runs, "h100-8", shape, [timed("mlx5_0", 1.5), timed_out])
    assert (result.verdict, result.reason) == (
        Verdict.ERROR,
        "mlx5_1 latency: ib_write_lat loopback on mlx5_1 did not finish within 30 s",
    )


def test_the_policy_reads_the_latency_ceiling_and_iterations() -> None:
    deep = DeepChecks.model_validate(
        {
            "shapes": {"h100-8": {"gpus": 8, "busbw_floor_gbps": 400, "nic_lat_ceiling_us": 2.5}},
            "nic_loopback": {"latency_iterations": 10000},
        }
    )
    assert (deep.shapes["h100-8"].nic_lat_ceiling_us, deep.nic_loopback.latency_iterations) == (2.5, 10000)
    assert (SHAPE.nic_lat_ceiling_us, DeepChecks().nic_loopback.latency_iterations) == (None, 1000)
    with pytest.raises(ValueError, match="nic_lat_ceiling_us"):
        Shape.model_validate({"gpus": 8, "busbw_floor_gbps": 400, "nic_lat_ceiling_us": 0})


def test_the_latency_script_runs_a_server_and_reads_the_clients_table(stand_in: Path) -> None:
    tool = stand_in / "ib_write_lat"
    tool.write_text(
        f'#!/bin/sh\nfor last; do :; done\nif [ "$last" = localhost ]; then cat {FIXTURES / "lat_roce_rdma_cm_2B.txt"}; '
        f'else echo "$*" > {stand_in / "server"}; fi\n'
    )
    tool.chmod(0o755)
    run = IbWriteBwLoopback(LocalRunner(aliases=[NODE])).latency(NODE, "mlx5_0", 1000, 30)
    assert (run.error, run.typical_us) == (None, 1.47)
    assert (stand_in / "server").read_text() == "-d mlx5_0 -n 1000 -F\n"


def test_the_latency_script_says_when_ib_write_lat_is_not_on_the_node(stand_in: Path) -> None:
    run = IbWriteBwLoopback(LocalRunner(aliases=[NODE])).latency(NODE, "mlx5_0", 1000, 30)
    assert (run.missing_tool, run.error) == ("ib_write_lat", None)
