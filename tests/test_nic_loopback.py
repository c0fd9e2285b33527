"""perftest's ib_write_bw in loopback (integrations/nic_loopback.py): its real output read from the
runs people posted (tests/fixtures/perftest/SOURCES.md), the command run for real on this machine
against a stand-in ib_write_bw, and the `nic_loopback` check judged against the shape's floor."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from integrations.dcgm.runner import Completed, LocalRunner
from integrations.nic_loopback import MISSING, IbWriteBwLoopback, PerftestOutputError, parse_output
from medic.deep_check import Verdict, judge_nic_loopback, overall
from medic.policy.deep_checks import DeepChecks, Shape
from medic.protocols import NicLoopbackRun

FIXTURES = Path(__file__).parent / "fixtures" / "perftest"
LOOPBACK = (FIXTURES / "loopback_ib0_8M_mbsec.txt").read_text()
ROCE = (FIXTURES / "roce_8B_60s_gbsec.txt").read_text()
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


def test_every_fixture_is_read() -> None:
    assert sorted(p.name for p in FIXTURES.glob("*.txt")) == [
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
