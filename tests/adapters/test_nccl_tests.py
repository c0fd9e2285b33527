"""nccl-tests' all_reduce_perf: its output read from real runs of several versions
(tests/fixtures/nccl_tests/, SOURCES.md there), refused with a reason when it is not a complete
run, and the runner driving a stand-in `mpirun` that prints those outputs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from checkout import TEST_FIXTURES

from medic.deep_check import Verdict, judge_all_reduce
from medic.integrations.nccl_tests import (
    NcclTestsAllReduce,
    NcclTestsConfigError,
    NcclTestsOutputError,
    parse_output,
)
from medic.policy.deep_checks import Shape
from medic.protocols import AllReduceSpec

FIXTURES = TEST_FIXTURES / "nccl_tests"
H100 = FIXTURES / "v2.16_h100_2node_16rank_mpirun.txt"
WRONG = FIXTURES / "v2.17.8_gh200_2node_wrong_results.txt"
CSCS = FIXTURES / "v2.18.2_gh200_2node_srun.txt"


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# file -> version, test, ranks, hosts, correctness column, result lines, largest size, busbw there
# (the lower of out-of-place and in-place), out of bounds, average busbw.
EXPECTED = {
    "pre-2.13_error_column_k80_4rank.txt": (
        None,
        None,
        4,
        ["2e3f9af7241040529530e810ce60fe5d000002"],
        "error",
        7,
        2147483648,
        2.56,
        0,
        2.54225,
    ),
    "v2.16_h100_2node_16rank_mpirun.txt": (
        None,
        None,
        16,
        ["ztan-mig-235z", "ztan-mig-gq73"],
        "#wrong",
        31,
        8589934592,
        337.35,
        0,
        70.742,
    ),
    "v2.17.8_gh200_2node_wrong_results.txt": (
        "2.17.8",
        "all_reduce_perf",
        2,
        ["gpu-1-1", "gpu-1-7"],
        "#wrong",
        25,
        134217728,
        22.8,
        4,
        4.79995,
    ),
    "v2.18.0_mpirun_tag_output.txt": (
        "2.18.0",
        "all_reduce_perf_mpi",
        2,
        ["lab"],
        "#wrong",
        8,
        134217728,
        2.30,
        0,
        1.57614,
    ),
    "v2.18.2_gh200_2node_srun.txt": (
        "2.18.2",
        "all_reduce_perf",
        2,
        ["nid007106", "nid007109"],
        "#wrong",
        8,
        134217728,
        22.86,
        0,
        14.9966,
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_version_is_read(name: str) -> None:
    report = parse_output(text(FIXTURES / name))
    got = (
        report.version,
        report.test,
        len(report.devices),
        report.hosts,
        report.wrong_column,
        len(report.rows),
        report.largest_bytes,
        report.busbw_at_largest,
        report.out_of_bounds,
        report.avg_busbw_gbps,
    )
    assert got == EXPECTED[name]
    assert report.validation


def test_a_rank_line_and_a_result_line_are_read_field_by_field() -> None:
    report = parse_output(text(H100))
    rank = report.devices[9]
    assert (rank.rank, rank.group, rank.pid, rank.host, rank.device, rank.bus_id, rank.name) == (
        9,
        0,
        6734,
        "ztan-mig-gq73",
        1,
        "0000:05:00",
        "NVIDIA H100 80GB HBM3",
    )
    last = report.rows[-1]
    assert (last.size, last.count, last.type, last.redop, last.root) == (
        8589934592,
        2147483648,
        "float",
        "sum",
        -1,
    )
    assert (last.out_of_place.time_us, last.out_of_place.algbw_gbps, last.out_of_place.busbw_gbps) == (
        47535,
        180.71,
        338.82,
    )
    assert (last.in_place.busbw_gbps, last.in_place.wrong) == (337.35, 0)
    assert (report.min_bytes, report.max_bytes, report.step, report.step_kind) == (8, 8589934592, 2, "factor")


def test_the_layout_before_2_13_has_no_root_and_a_deviation_for_correctness() -> None:
    report = parse_output(text(FIXTURES / "pre-2.13_error_column_k80_4rank.txt"))
    first = report.rows[0]
    assert (first.redop, first.root, first.out_of_place.wrong) == ("sum", None, 2e-07)
    assert (report.devices[0].group, report.devices[0].pid, report.devices[0].bus_id) == (None, 195, "0x00")
    # A deviation is nccl-tests' to judge (its out-of-bounds count), not a count of wrong elements.
    assert report.wrong_elements() == []


def test_wrong_elements_and_each_ranks_failure_are_reported() -> None:
    report = parse_output(text(WRONG))
    assert report.wrong_elements() == ["1048576 B out-of-place: 96", "1048576 B in-place: 32"]
    assert report.failures == [
        ".. gpu-1-1 pid 662195: Test failure common.cu:1189",
        ".. gpu-1-7 pid 2448661: Test failure common.cu:1189",
    ]


def test_a_run_that_failed_before_its_results_is_refused_with_what_it_said() -> None:
    with pytest.raises(NcclTestsOutputError) as refused:
        parse_output(text(FIXTURES / "v2.17.8_gh200_2node_cuda_failure.txt"))
    said = str(refused.value)
    assert said.startswith("the run ended before its first result; it reported: gpu-1-1: Test CUDA failure")
    assert "'CUDA-capable device(s) is/are busy or unavailable'" in said
    assert said.endswith("| and 4 more")  # every rank says the same: each distinct line once


def cut(path: Path, lines: int) -> str:
    return "".join(text(path).splitlines(keepends=True)[:lines])


@pytest.mark.parametrize(
    ("output", "reason"),
    [
        ("", "no nccl-tests header (`# nThread ... nGpus ...`)"),
        ("Segmentation fault (core dumped)\n", "no nccl-tests header"),
        (cut(H100, 3), "no rank lines"),
        (cut(H100, 22), "the run ended before its first result"),
        (cut(H100, 40), "cut short after 17 results, up to 524288 B: no `Out of bounds values` line"),
        (cut(H100, 54), "cut short after 31 results, up to 8589934592 B: no `Out of bounds values` line"),
        (cut(H100, 55), "cut short after 31 results, up to 8589934592 B: no `Avg bus bandwidth` line"),
        (text(CSCS) + text(CSCS), "2 runs in one output, each with its own header"),
        (text(CSCS).replace("8.81    8.81", "8.81    n/a!", 1), "busbw 'n/a!' is not a number"),
        (
            text(CSCS).replace("starting: all_reduce_perf", "starting: alltoall_perf"),
            "output of alltoall_perf",
        ),
        (text(CSCS).replace("Rank  1 Group", "Rank  3 Group"), "rank lines are not ranks 0 to 1: [0, 3]"),
    ],
)
def test_output_that_is_not_a_complete_run_is_refused_with_a_reason(output: str, reason: str) -> None:
    with pytest.raises(NcclTestsOutputError) as refused:
        parse_output(output)
    assert reason in str(refused.value)


def test_a_truncated_line_is_named() -> None:
    truncated = cut(H100, 53) + "  8589934592    2147483648     float     sum      -1    47535  180."
    with pytest.raises(NcclTestsOutputError) as refused:
        parse_output(truncated)
    assert str(refused.value) == (
        "result line with 7 columns where the table has 13 (cut short?): "
        "'8589934592    2147483648     float     sum      -1    47535  180.'"
    )


# --- the runner -------------------------------------------------------------------------------

SPEC = AllReduceSpec(("gpu-node-1", "gpu-node-2"), 8, 8, 8589934592, 2)
H100_SHAPE = Shape(gpus=8, nvlinks_per_gpu=18, busbw_floor_gbps=450, multi_node_busbw_floor_gbps=330)


def test_the_commands_start_one_rank_per_gpu_and_check_every_result() -> None:
    test = ["all_reduce_perf", "-b", "8", "-e", "8589934592", "-f", "2", "-g", "1", "-c", "1"]
    mpirun = NcclTestsAllReduce("mpirun", ("--allow-run-as-root",))
    assert mpirun.command(SPEC) == [
        "mpirun",
        "-np",
        "16",
        "--host",
        "gpu-node-1:8,gpu-node-2:8",
        "--bind-to",
        "none",
        "--allow-run-as-root",
        *test,
    ]
    srun = NcclTestsAllReduce.from_env(
        {"MEDIC_NCCL_LAUNCHER": "srun", "MEDIC_NCCL_LAUNCHER_ARGS": "--mpi=pmix --reservation='medic maint'"}
    )
    assert srun.command(SPEC) == [
        "srun",
        "--nodes=2",
        "--nodelist=gpu-node-1,gpu-node-2",
        "--ntasks-per-node=8",
        "--immediate=30",
        "--quiet",
        "--mpi=pmix",
        "--reservation=medic maint",
        *test,
    ]
    with pytest.raises(NcclTestsConfigError, match="choose one of mpirun, srun"):
        NcclTestsAllReduce.from_env({"MEDIC_NCCL_LAUNCHER": "pdsh"})


FAKE_MPIRUN = """#!/bin/sh
echo "$*" > "$FAKE_MPIRUN_ARGS"
[ "$FAKE_MPIRUN_MODE" = hang ] && exec sleep 600
cat "$FAKE_MPIRUN_OUTPUT"
exit "${FAKE_MPIRUN_RC:-0}"
"""


@pytest.fixture
def mpirun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A stand-in `mpirun` first on PATH, printing a saved all_reduce_perf output."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "mpirun"
    fake.write_text(FAKE_MPIRUN)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPIRUN_ARGS", str(tmp_path / "args"))
    return monkeypatch


def test_a_run_is_read_and_judged_from_what_all_reduce_perf_printed(
    mpirun: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mpirun.setenv("FAKE_MPIRUN_OUTPUT", str(H100))
    spec = AllReduceSpec(("ztan-mig-235z", "ztan-mig-gq73"), 8, 8, 8589934592, 2)
    run = NcclTestsAllReduce().run(spec, timeout_s=30)
    assert run.error is None
    assert (run.ranks, run.hosts, run.largest_bytes, run.busbw_gbps, run.out_of_bounds) == (
        16,
        ("ztan-mig-235z", "ztan-mig-gq73"),
        8589934592,
        337.35,
        0,
    )
    assert run.output == text(H100)
    assert (tmp_path / "args").read_text().split()[:5] == [
        "-np",
        "16",
        "--host",
        "ztan-mig-235z:8,ztan-mig-gq73:8",
        "--bind-to",
    ]
    judged = judge_all_reduce(run, "h100-8", H100_SHAPE)
    assert (judged.verdict, judged.reason) == (
        Verdict.PASS,
        "busbw 337.35 GB/s at 8 GiB on 16 ranks, floor 330 GB/s",
    )
    stricter = H100_SHAPE.model_copy(update={"multi_node_busbw_floor_gbps": 350})
    assert judge_all_reduce(run, "h100-8", stricter).reason == (
        "busbw 337.35 GB/s at 8 GiB, under the floor of 350 GB/s of shape h100-8"
    )


def test_wrong_results_fail_whatever_the_bandwidth(mpirun: pytest.MonkeyPatch) -> None:
    mpirun.setenv("FAKE_MPIRUN_OUTPUT", str(WRONG))
    mpirun.setenv("FAKE_MPIRUN_RC", "1")  # all_reduce_perf exits nonzero when results were wrong
    spec = AllReduceSpec(("gpu-1-1", "gpu-1-7"), 1, 8, 134217728, 2)
    run = NcclTestsAllReduce().run(spec, timeout_s=30)
    gh200 = Shape(gpus=1, busbw_floor_gbps=20)
    judged = judge_all_reduce(run, "gh200-1", gh200)
    assert judged.verdict is Verdict.FAIL
    assert judged.reason == (
        "wrong results: 4 out of bounds values; "
        "wrong elements at 1048576 B out-of-place: 96; 1048576 B in-place: 32; "
        ".. gpu-1-1 pid 662195: Test failure common.cu:1189; "
        ".. gpu-1-7 pid 2448661: Test failure common.cu:1189; "
        "`mpirun` exited 1"
    )


def test_a_run_on_other_hosts_or_fewer_ranks_than_asked_fails(mpirun: pytest.MonkeyPatch) -> None:
    mpirun.setenv("FAKE_MPIRUN_OUTPUT", str(CSCS))
    run = NcclTestsAllReduce().run(SPEC, timeout_s=30)
    judged = judge_all_reduce(run, "h100-8", H100_SHAPE)
    assert judged.verdict is Verdict.FAIL
    assert judged.reason.startswith(
        "ran on 2 ranks, 16 expected; ran on nid007106, nid007109, not on gpu-node-1, gpu-node-2; busbw 22.86"
    )


@pytest.mark.parametrize(
    ("setup", "error"),
    [
        (
            {
                "FAKE_MPIRUN_OUTPUT": str(FIXTURES / "v2.17.8_gh200_2node_cuda_failure.txt"),
                "FAKE_MPIRUN_RC": "1",
            },
            "all_reduce_perf output unusable (`mpirun` exited 1): the run ended before its first result",
        ),
        (
            {"FAKE_MPIRUN_OUTPUT": "/dev/null", "FAKE_MPIRUN_RC": "213"},
            "all_reduce_perf output unusable (`mpirun` exited 213): no nccl-tests header",
        ),
    ],
)
def test_a_run_without_results_is_an_error(
    mpirun: pytest.MonkeyPatch, setup: dict[str, str], error: str
) -> None:
    for name, value in setup.items():
        mpirun.setenv(name, value)
    run = NcclTestsAllReduce().run(SPEC, timeout_s=30)
    assert run.error is not None and run.error.startswith(error)
    assert judge_all_reduce(run, "h100-8", H100_SHAPE).verdict is Verdict.ERROR


def test_results_that_were_not_checked_are_no_verdict(mpirun: pytest.MonkeyPatch, tmp_path: Path) -> None:
    unchecked = tmp_path / "unchecked.txt"
    unchecked.write_text(text(H100).replace("validation: 1", "validation: 0"))
    mpirun.setenv("FAKE_MPIRUN_OUTPUT", str(unchecked))
    run = NcclTestsAllReduce().run(SPEC, timeout_s=30)
    assert run.error == "all_reduce_perf did not check its results (validation: 0)"


def test_a_hung_run_is_killed_and_no_verdict(mpirun: pytest.MonkeyPatch) -> None:
    mpirun.setenv("FAKE_MPIRUN_MODE", "hang")
    run = NcclTestsAllReduce(term_grace_s=0.2).run(SPEC, timeout_s=0.5)
    assert run.error is not None
    assert run.error.startswith("the all-reduce did not finish within 0.5 s; `mpirun -np 16")


def test_a_missing_launcher_or_a_node_list_is_no_verdict(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    run = NcclTestsAllReduce().run(SPEC, timeout_s=5)
    assert run.error is not None and run.error.startswith("could not start `mpirun -np 16")
    bad = AllReduceSpec(("gpu[01-04]",), 8, 8, 1024, 2)
    assert NcclTestsAllReduce().run(bad, timeout_s=5).error == (
        "not an all-reduce that can be started: nodes ['gpu[01-04]'], 8 GPUs each"
    )
