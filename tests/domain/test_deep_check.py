"""The deep checks' judgement (medic/deep_check.py), the policy's `deep_checks` section, and the NVML
probe read for real through nvidia-ml-py and the NVML shim (tests/nvml_shim/) in a child process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from nvml_support import DRIVER_NOT_LOADED, ShimState, build_shim, shim_env

from medic.deep_check import (
    CheckResult,
    Verdict,
    judge_all_reduce,
    judge_dcgm,
    judge_gpu_count,
    judge_nvlink,
    overall,
    summary,
    unfit_for_stress,
    verify_checks,
)
from medic.integrations.dcgm.runner import LocalRunner
from medic.integrations.nvml_probe import NvmlProbe
from medic.policy import Action, Mode, PolicyError, load_policy
from medic.policy.deep_checks import CheckName, DeepChecks, Shape
from medic.policy.loader import parse_policy
from medic.protocols import (
    AllReduceRun,
    AllReduceSpec,
    DiagnosticResult,
    GpuReading,
    InstanceReading,
    JobInfo,
    JobState,
    NodeInfo,
    NodeState,
)

NODE = "gpu-node-1"
H100 = Shape(gpus=8, nvlinks_per_gpu=18, busbw_floor_gbps=400, multi_node_busbw_floor_gbps=300)
RULES = """\
rules:
  - id: fallen-off
    description: XID 79
    when: {xid: [79]}
    then: {classification: hardware, action: replace}
"""
DEEP = """\
deep_checks:
  dcgm_level: 3
  shapes:
    h100-8: {gpus: 8, nvlinks_per_gpu: 18, busbw_floor_gbps: 400, multi_node_busbw_floor_gbps: 300}
    a100-8: {gpus: 8, nvlinks_per_gpu: 12, busbw_floor_gbps: 220}
  nodes:
    "gpu-node-1": a100-8
    "gpu-node-*": h100-8
  all_reduce: {min_bytes: 1048576, max_bytes: 4294967296}
  require:
    after_replace: [all_reduce, gpu_count, dcgm, nvlink]
    after_repair: [gpu_count]
"""


def test_the_section_reads_shapes_nodes_sizes_and_what_each_transition_requires() -> None:
    deep = parse_policy(DEEP + RULES, "deep.yaml").deep_checks
    assert deep.shape_of("gpu-node-1") == ("a100-8", deep.shapes["a100-8"])  # the first match wins
    assert deep.shape_of("gpu-node-12") == ("h100-8", H100)
    assert deep.shape_of("login-1") is None
    assert (deep.all_reduce.min_bytes, deep.all_reduce.max_bytes, deep.all_reduce.step_factor) == (
        1048576,
        4294967296,
        2,
    )
    # Listed in any order, run in the suite's: the cheap reads first, the all-reduce last.
    assert deep.required(replaced=True) == (
        CheckName.GPU_COUNT,
        CheckName.NVLINK,
        CheckName.DCGM,
        CheckName.ALL_REDUCE,
    )
    assert deep.required(replaced=False) == (CheckName.GPU_COUNT,)
    assert H100.floor(1) == 400 and H100.floor(2) == 300
    assert deep.shapes["a100-8"].floor(4) == 220  # no multi-node floor: the node's own


def test_a_policy_without_the_section_requires_nothing() -> None:
    deep = parse_policy(RULES, "plain.yaml").deep_checks
    assert deep == DeepChecks()
    assert deep.required(replaced=True) == deep.required(replaced=False) == ()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            ('"gpu-node-*": h100-8', '"gpu-node-*": h100-16'),
            "7:5: deep_checks.nodes: names shapes that `shapes` does not define: h100-16 (known: a100-8, h100-8)",
        ),
        (
            ("after_repair: [gpu_count]", "after_repair: [gpus]"),
            "deep_checks.require.after_repair.0: expected",
        ),
        (
            ("busbw_floor_gbps: 220", "busbw_floor_gbps: 0"),
            "5:62: deep_checks.shapes.a100-8.busbw_floor_gbps: Input should be greater than 0",
        ),
        (
            ("min_bytes: 1048576", "min_bytes: 8589934592"),
            "9:15: deep_checks.all_reduce: min_bytes is larger than max_bytes",
        ),
    ],
)
def test_a_mistake_in_the_section_is_refused_where_it_is(
    tmp_path: Path, change: tuple[str, str], problem: str
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text((DEEP + RULES).replace(*change))
    with pytest.raises(PolicyError) as refused:
        load_policy(path)
    assert problem in str(refused.value), str(refused.value)


def test_checks_that_need_a_shape_need_nodes_with_one(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("deep_checks:\n  require: {after_replace: [all_reduce]}\n" + RULES)
    with pytest.raises(PolicyError) as refused:
        load_policy(path)
    assert str(refused.value).endswith(
        ":2:12: deep_checks.require: names all_reduce, which judge a node against its shape, "
        "but `nodes` gives no node a shape"
    )


def test_verification_always_runs_dcgm_at_the_higher_level() -> None:
    deep = parse_policy(DEEP + RULES, "deep.yaml").deep_checks
    assert verify_checks(deep, 1, Action.REPLACE) == (
        (CheckName.GPU_COUNT, CheckName.NVLINK, CheckName.DCGM, CheckName.ALL_REDUCE),
        3,
    )
    # A repair does not require `dcgm` here: the policy's verify level stands.
    assert verify_checks(deep, 1, Action.REBOOT) == ((CheckName.GPU_COUNT, CheckName.DCGM), 1)
    assert verify_checks(deep, 4, Action.REPLACE)[1] == 4
    assert verify_checks(DeepChecks(), 2, Action.RESET_GPU) == ((CheckName.DCGM,), 2)


# --- judging what the node shows --------------------------------------------------------------


def reading(*gpus: GpuReading, count: int | None = None) -> InstanceReading:
    return InstanceReading(NODE, len(gpus) if count is None else count, gpus)


def healthy(index: int, links: int = 18) -> GpuReading:
    return GpuReading(index, "NVIDIA H100 80GB HBM3", links_up=tuple(range(links)))


def test_every_gpu_of_the_shape_answering_passes() -> None:
    node = reading(*(healthy(i) for i in range(8)))
    gpus, links = judge_gpu_count(node, "h100-8", H100), judge_nvlink(node, "h100-8", H100)
    assert (gpus.verdict, gpus.reason) == (Verdict.PASS, "8 of 8 GPUs answer")
    assert (links.verdict, links.reason) == (Verdict.PASS, "18 links up on each of 8 GPUs")
    assert links.measured["links_up"] == dict.fromkeys(range(8), 18)


def test_a_missing_or_lost_gpu_and_a_link_down_fail_with_where() -> None:
    down = GpuReading(4, links_up=tuple(x for x in range(18) if x not in (3, 7)), links_down=(3, 7))
    lost = GpuReading(2, lost=True)
    node = reading(*(healthy(i) for i in (0, 1, 3, 5, 6)), lost, down, count=7)
    gpus, links = judge_gpu_count(node, "h100-8", H100), judge_nvlink(node, "h100-8", H100)
    assert (gpus.verdict, gpus.reason) == (
        Verdict.FAIL,
        "the driver enumerates 7 GPUs, shape h100-8 has 8; GPU 2 does not answer",
    )
    assert gpus.measured == {"expected": 8, "enumerated": 7, "answering": 6, "lost": [2]}
    assert (links.verdict, links.reason) == (
        Verdict.FAIL,
        "GPU 2: lost, no link read; GPU 4: 16 of 18 links up (down: 3, 7)",
    )


def test_a_pcie_shape_has_no_links_to_check() -> None:
    pcie = Shape(gpus=4, busbw_floor_gbps=20)
    node = reading(*(GpuReading(i) for i in range(4)))
    assert judge_nvlink(node, "l40s-4", pcie).reason == "shape l40s-4 has no NVLink to check"


def test_an_unread_node_is_no_verdict() -> None:
    node = InstanceReading(NODE, error="NVML on gpu-node-1: NVML: Driver Not Loaded")
    for judge in (judge_gpu_count, judge_nvlink):
        result = judge(node, "h100-8", H100)
        assert (result.verdict, result.reason) == (
            Verdict.ERROR,
            "the GPUs of gpu-node-1 could not be read: NVML on gpu-node-1: NVML: Driver Not Loaded",
        )


def test_dcgm_is_as_dcgm_says_and_an_error_is_no_pass() -> None:
    for said, verdict in (("pass", Verdict.PASS), ("fail", Verdict.FAIL), ("error", Verdict.ERROR)):
        result = judge_dcgm(DiagnosticResult(NODE, 4, said, detail=f"DCGM level 4 {said} on {NODE}"))
        assert (result.verdict, result.reason, result.measured["level"]) == (
            verdict,
            f"DCGM level 4 {said} on {NODE}",
            4,
        )


SPEC = AllReduceSpec((NODE,), 8, 8, 8589934592, 2)


def measured(busbw: float, **changes: object) -> AllReduceRun:
    base = {
        "ranks": 8,
        "hosts": (NODE,),
        "largest_bytes": 8589934592,
        "busbw_gbps": busbw,
        "out_of_bounds": 0,
    }
    return AllReduceRun(SPEC, **(base | changes))  # type: ignore[arg-type]  # the test's own fields


def test_the_all_reduce_is_judged_against_the_shapes_floor() -> None:
    assert judge_all_reduce(measured(480.5), "h100-8", H100).reason == (
        "busbw 480.5 GB/s at 8 GiB on 8 ranks, floor 400 GB/s"
    )
    slow = judge_all_reduce(measured(380), "h100-8", H100)
    assert (slow.verdict, slow.reason) == (
        Verdict.FAIL,
        "busbw 380 GB/s at 8 GiB, under the floor of 400 GB/s of shape h100-8",
    )
    assert slow.measured["floor_gbps"] == 400
    # A fully qualified host name is the node.
    assert judge_all_reduce(measured(480, hosts=(f"{NODE}.cluster.local",)), "h100-8", H100).passed


def test_an_all_reduce_that_measured_nothing_is_no_verdict() -> None:
    run = AllReduceRun(SPEC, error="the all-reduce did not finish within 60 s")
    assert judge_all_reduce(run, "h100-8", H100).verdict is Verdict.ERROR


def test_the_gpus_are_loaded_only_on_a_node_out_of_service_without_jobs() -> None:
    drained = NodeInfo(NODE, NodeState.DRAINED, "medic: replace incident inc-1")
    assert unfit_for_stress(drained, []) is None
    assert unfit_for_stress(NodeInfo(NODE, NodeState.IDLE), []) == (
        "gpu-node-1 is idle, in service: drain it first, the check loads every GPU"
    )
    job = JobInfo("llm", JobState.RUNNING, (NODE,))
    done = JobInfo("old", JobState.COMPLETED, (NODE,))
    assert unfit_for_stress(drained, [job, done]) == "job llm still runs on gpu-node-1"


def result(check: CheckName, verdict: Verdict) -> CheckResult:
    return CheckResult(check=check, nodes=[NODE], verdict=verdict, reason=verdict.value)


def test_only_every_check_passing_is_a_pass() -> None:
    ok = result(CheckName.GPU_COUNT, Verdict.PASS)
    assert overall([ok, result(CheckName.DCGM, Verdict.PASS)]) is Verdict.PASS
    assert overall([ok, result(CheckName.NVLINK, Verdict.FAIL), result(CheckName.DCGM, Verdict.ERROR)]) is (
        Verdict.FAIL
    )
    assert overall([ok, result(CheckName.ALL_REDUCE, Verdict.SKIPPED)]) is Verdict.ERROR
    assert overall([]) is Verdict.ERROR
    assert summary([ok, result(CheckName.NVLINK, Verdict.FAIL)]) == (
        "gpu_count passed; nvlink on gpu-node-1 fail: fail"
    )


# --- the NVML probe, through nvidia-ml-py and the shim ------------------------------------------


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shim(tmp_path_factory.mktemp("nvml-shim"))


def probe_read(shim: Path | None, state: ShimState, monkeypatch: pytest.MonkeyPatch) -> InstanceReading:
    """`python -m medic.integrations.nvml` run by the local runner, as on the node itself."""
    for name, value in shim_env(shim, state).items():
        monkeypatch.setenv(name, value)
    if shim is None:
        monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    return NvmlProbe(LocalRunner(aliases=[NODE]), python=sys.executable).read(NODE, timeout_s=60)


def test_the_probe_reads_the_gpus_and_links_nvml_reports(
    shim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = probe_read(shim, ShimState(tmp_path / "state"), monkeypatch)
    assert (node.error, node.gpu_count, len(node.gpus)) == (None, 8, 8)
    assert node.gpus[0] == GpuReading(0, "NVIDIA H100 80GB HBM3", links_up=tuple(range(18)))
    assert '"type": "NodeSnapshot"' in node.output
    assert judge_nvlink(node, "h100-8", H100).passed and judge_gpu_count(node, "h100-8", H100).passed


def test_the_probe_sees_a_gpu_gone_one_lost_and_links_down(
    shim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = ShimState(tmp_path / "state", count=7)
    state.gpu(2, lost=1)
    state.gpu(4, nvlink_down=(1 << 3) | (1 << 7))
    node = probe_read(shim, state, monkeypatch)
    assert node.gpu_count == 7
    assert (node.gpus[2].lost, node.gpus[4].links_down) == (True, (3, 7))
    assert judge_gpu_count(node, "h100-8", H100).reason == (
        "the driver enumerates 7 GPUs, shape h100-8 has 8; GPU 2 does not answer"
    )
    assert judge_nvlink(node, "h100-8", H100).reason == (
        "GPU 2: lost, no link read; GPU 4: 16 of 18 links up (down: 3, 7)"
    )


def test_a_node_without_a_working_driver_is_an_error_reading(
    shim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    down = probe_read(shim, ShimState(tmp_path / "state", init_rc=DRIVER_NOT_LOADED), monkeypatch)
    assert down.error == "NVML on gpu-node-1: NVML: Driver Not Loaded"
    none = probe_read(None, ShimState(tmp_path / "none"), monkeypatch)
    assert none.error is not None and none.error.startswith("NVML on gpu-node-1: NVML: ")
    assert judge_gpu_count(none, "h100-8", H100).verdict is Verdict.ERROR


def test_the_probe_refuses_a_node_it_cannot_reach() -> None:
    other = NvmlProbe(LocalRunner(), python=sys.executable).read("gpu-node-99", timeout_s=5)
    assert other.error is not None and other.error.startswith("could not start `")
    assert "the local runner runs on" in other.error


def test_the_dry_run_names_the_checks_verification_will_run() -> None:
    from medic.apps.cli.plan import plan_steps
    from medic.policy import Classification, Decision

    deep = parse_policy(DEEP + RULES, "deep.yaml").deep_checks
    replace = Decision(
        incident="inc-1", classification=Classification.HARDWARE, action=Action.REPLACE, rule="r", reason="r"
    )
    assert plan_steps(replace, NODE, "inc-1", [], 1, deep)[2] == (
        "verify gpu-node-1 at DCGM level 3 and its gpu_count, nvlink, all_reduce checks, then resume it (or escalate)"
    )
    assert plan_steps(replace, NODE, "inc-1", [], 1, DeepChecks())[2] == (
        "verify gpu-node-1 at DCGM level 1, then resume it (or escalate)"
    )
    watched = replace.model_copy(update={"mode": Mode.OBSERVE, "group": "canary"})
    assert plan_steps(watched, NODE, "inc-1", ["llm"], 1, deep) == [
        "observe mode (group canary): touch nothing",
        "tell the owner: would have replace gpu-node-1",
    ]


def test_a_long_output_keeps_its_head_and_its_tail() -> None:
    from medic.tasks.deep_check import KEPT_HEAD, KEPT_TAIL, kept

    short = "# nThread 1 nGpus 1\n" * 10
    assert kept(short) == short
    long = "H" * KEPT_HEAD + "x" * 1000 + "T" * KEPT_TAIL
    assert kept(long) == f"{'H' * KEPT_HEAD}\n[… 1000 characters left out …]\n{'T' * KEPT_TAIL}"
