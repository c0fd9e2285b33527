"""medic/whatif/fleetsim and `medic simulate`, checked against Meta's Llama 3 figures and the resiliency literature."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from checkout import REPO_ROOT
from typer.testing import CliRunner

from medic.advise import optimal_interval
from medic.apps.cli.app import app
from medic.policy import LoadedPolicy, load_policy
from medic.whatif.fleetsim import BADPUT, SimParams, fast_checkpointer, meta_like_recovery, simulate
from medic.whatif.fleetsim.decisions import Decider, Shape
from medic.whatif.fleetsim.failures import CAUSES, TABLE_INTERRUPTIONS, Signature

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"
SEED = 11
runner = CliRunner()

REBOOT_ANYTHING = """\
version: 1
description: Reboot the node on any hardware signal, as a script without GPU Medic would.
rules:
  - id: reboot-on-hardware-signal
    description: Any GPU, node or network signal reboots the node
    when:
      kinds: [xid, gpu_missing, node_unreachable, ecc, dcgm_health, thermal, straggler, nccl_timeout, health_check]
    then: {classification: hardware, action: reboot}
  - id: restart-on-job-failure
    description: The job failed on its own
    when:
      kinds: [nan_loss, job_crash]
      not_kinds: [xid, gpu_missing, node_unreachable, ecc, dcgm_health, thermal, straggler, nccl_timeout, health_check]
    then: {classification: software, action: none}
"""

REPLACE_ANYTHING = """\
version: 1
description: Replace the node whatever happened.
rules:
  - id: replace-always
    description: Any event replaces the node
    when:
      kinds: [xid, gpu_missing, node_unreachable, ecc, dcgm_health, thermal, straggler, nccl_timeout, health_check, nan_loss, job_crash]
    then: {classification: hardware, action: replace}
"""


@pytest.fixture(scope="module")
def default() -> LoadedPolicy:
    return load_policy(DEFAULT_POLICY)


def _policy(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _within_poisson(observed: int, expected: float, sigmas: float = 3.0) -> bool:
    return abs(observed - expected) <= sigmas * math.sqrt(expected)


# --- the failure model against Meta's table -----------------------------------------------------


def test_the_causes_are_metas_table_of_419_unexpected_interruptions() -> None:
    counts = {c.name: c.interruptions for c in CAUSES}
    assert TABLE_INTERRUPTIONS == 419
    assert counts["faulty GPU"] == 148
    assert counts["GPU HBM3 memory"] / 419 == pytest.approx(0.172, abs=0.0005)
    assert counts["software bug"] / 419 == pytest.approx(0.129, abs=0.0005)
    assert counts["network switch/cable"] / 419 == pytest.approx(0.084, abs=0.0005)
    assert (counts["GPU SRAM memory"] + counts["GPU system processor"]) / 419 == pytest.approx(
        0.086, abs=0.0005
    )


def test_a_llama3_like_fleet_sees_about_419_faults_in_54_days(default: LoadedPolicy) -> None:
    report = simulate(SimParams(), default, SEED)
    assert SimParams().gpu_mtbf_hours == pytest.approx(54 * 24 * 16_384 / 419)
    assert _within_poisson(report.faults, 419)
    # GPUs and their memory cause about half, as in the paper (148 + 72 of 419).
    gpu_share = (report.by_cause["faulty GPU"] + report.by_cause["GPU HBM3 memory"]) / report.interruptions
    assert 0.4 < gpu_share < 0.65
    # The repeats are the faults the default policy left in place a first time, on top of the draws.
    assert report.interruptions == report.faults + report.repeats
    assert 0 < report.repeats < report.faults / 2


@pytest.mark.parametrize(("gpus", "hours"), [(1_000, 50.0), (10_000, 5.0), (100_000, 0.5), (1_000_000, 0.05)])
def test_cluster_mtbf_is_the_gpu_mtbf_over_the_cluster_size(
    default: LoadedPolicy, gpus: int, hours: float
) -> None:
    expected_faults = 400
    params = SimParams(gpus=gpus, gpu_mtbf_hours=50_000, days=expected_faults * hours / 24)
    report = simulate(params, default, SEED)
    assert _within_poisson(report.faults, expected_faults)
    assert report.wall_s / report.faults / 3600 == pytest.approx(hours, rel=3 / math.sqrt(expected_faults))


def test_checkpoints_every_youngs_interval_cost_about_2_1_percent(default: LoadedPolicy) -> None:
    # Instant recovery and no repeats: what is left is saving and redoing, Young's two terms.
    params = SimParams(
        checkpoint_save_s=2.5,
        detect_kernel_s=0,
        detect_health_s=0,
        detect_crash_s=0,
        detect_hang_s=0,
        restart_s=0,
        recurrence_hours=1e9,
    )
    assert params.interval_s == pytest.approx(optimal_interval(2.5, 54 * 24 * 3600 / 419))
    assert params.interval_s / 60 == pytest.approx(3.93, abs=0.01)
    report = simulate(params, default, SEED)
    overhead = (report.badput_s["checkpoint"] + report.badput_s["lost_work"]) / report.wall_s
    assert overhead == pytest.approx(0.0212, abs=0.003)
    # Against Young's model at the fault rate this run actually drew.
    tau, mtbf = report.checkpoint_interval_s, report.observed_mtbf_s
    assert overhead == pytest.approx(2.5 / (tau + 2.5) + tau / (2 * mtbf), rel=0.08)


# --- goodput ------------------------------------------------------------------------------------


def test_every_second_is_goodput_or_one_kind_of_badput(default: LoadedPolicy) -> None:
    report = simulate(SimParams(gpus=100_000, days=10), default, SEED)
    assert set(report.badput_s) == set(BADPUT)
    assert report.goodput_s + sum(report.badput_s.values()) == pytest.approx(report.wall_s)
    assert all(seconds >= 0 for seconds in report.badput_s.values())


def test_meta_like_slower_recovery_still_trains_more_than_90_percent_of_the_time(
    default: LoadedPolicy,
) -> None:
    meta = simulate(meta_like_recovery(SimParams()), default, SEED)
    ours = simulate(SimParams(), default, SEED)
    assert 0.90 < meta.goodput < ours.goodput
    assert meta.dominant_badput == "recovery"


def test_the_default_policy_and_a_fast_checkpointer_keep_97_percent(default: LoadedPolicy) -> None:
    report = simulate(fast_checkpointer(SimParams()), default, SEED)
    assert report.goodput >= 0.97
    assert report.badput_s[report.dominant_badput] == max(report.badput_s.values())
    assert report.false_replacements == 0


def test_the_same_seed_gives_the_same_report_and_another_seed_another(default: LoadedPolicy) -> None:
    params = SimParams(gpus=4096, days=20)
    first = simulate(params, default, SEED).to_dict()
    assert simulate(params, default, SEED).to_dict() == first
    assert json.dumps(first) == json.dumps(simulate(params, default, SEED).to_dict())
    assert simulate(params, default, SEED + 1).to_dict() != first


# --- the real engine decides -----------------------------------------------------------------------


def _signature(cause: str, name: str) -> Signature:
    found = next(c for c in CAUSES if c.name == cause)
    return next(s for s in found.signatures if s.name == name)


@pytest.mark.parametrize(
    ("cause", "signature", "history", "action", "rule"),
    [
        ("faulty GPU", "XID 79 fallen off the bus", 0, "reboot", "xid-fallen-off-bus"),
        ("faulty GPU", "XID 79 fallen off the bus", 1, "replace", "repeat-offender-replace"),
        ("GPU HBM3 memory", "XID 48 double-bit ECC", 0, "reset_gpu", "xid-reset-gpu"),
        ("GPU HBM3 memory", "XID 64 row remap failure", 0, "replace", "row-remap-failure"),
        ("software bug", "NaN loss", 0, "none", "application-fault"),
        (
            "network switch/cable",
            "switch down: timeouts under one switch",
            0,
            "escalate",
            "network-switch-storm",
        ),
        ("GPU SRAM memory", "DCGM SRAM threshold", 0, "diagnose", "dcgm-health-isolate"),
    ],
)
def test_the_policy_engine_decides_each_simulated_incident(
    default: LoadedPolicy, cause: str, signature: str, history: int, action: str, rule: str
) -> None:
    decider = Decider(default, switch_size=16)
    decision, _ = decider.decide(Shape(_signature(cause, signature), False, history, 0, ()))
    assert (decision.action.value, decision.rule) == (action, rule)


def test_a_failed_diagnostic_is_decided_again_and_a_silent_corruption_repeat_is_diagnosed(
    default: LoadedPolicy,
) -> None:
    decider = Decider(default, switch_size=16)
    sram = _signature("GPU SRAM memory", "DCGM SRAM threshold")
    decision, _ = decider.decide(Shape(sram, True, 0, 0, ((2, "fail", "DCGM_FR_SRAM_THRESHOLD"),)))
    assert (decision.action.value, decision.rule) == ("replace", "diag-isolate")
    # A NaN loss looks like the application's, until the same GPU shows it a third time in a day.
    sdc = _signature("silent data corruption", "NaN loss on a bad GPU")
    assert decider.decide(Shape(sdc, False, 0, 0, ()))[0].action.value == "none"
    assert decider.decide(Shape(sdc, False, 0, 2, ()))[0].rule == "application-signature-repeats-on-gpu"
    assert decider.decided == 3 and decider.asked == 3
    decider.decide(Shape(sdc, False, 0, 2, ()))
    assert (decider.decided, decider.asked) == (3, 4)  # the same shape is decided once


def test_a_policy_that_only_reboots_leaves_dead_gpus_in_and_calls_people_more(
    default: LoadedPolicy, tmp_path: Path
) -> None:
    rebooter = load_policy(_policy(tmp_path, "reboot.yaml", REBOOT_ANYTHING))
    ours = simulate(SimParams(), default, SEED)
    reboots = simulate(SimParams(), rebooter, SEED)
    assert reboots.faults == ours.faults  # the same faults, drawn before any decision
    assert reboots.repeats > ours.repeats
    assert reboots.human_interventions > 2 * ours.human_interventions
    assert reboots.goodput < ours.goodput
    assert reboots.actions.get("replace", 0) == 0


def test_replacing_nodes_for_software_faults_counts_false_replacements(
    default: LoadedPolicy, tmp_path: Path
) -> None:
    replacer = load_policy(_policy(tmp_path, "replace.yaml", REPLACE_ANYTHING))
    report = simulate(replace(SimParams(), spare_nodes=2), replacer, SEED)
    software = report.by_cause["software bug"] + report.by_cause.get("NCCL watchdog timeout", 0)
    assert report.false_replacements >= software
    assert report.nodes_replaced >= report.false_replacements
    # Two spares cannot cover a node away for hours at every fault: the job waits for nodes.
    assert report.badput_s["false_replacement"] > 0
    assert report.goodput < simulate(SimParams(), default, SEED).goodput


# --- the command --------------------------------------------------------------------------------


def test_simulate_json_is_one_object_per_policy(tmp_path: Path) -> None:
    other = _policy(tmp_path, "reboot.yaml", REBOOT_ANYTHING)
    args = ["simulate", "--gpus", "2048", "--days", "10", "--seed", "3", "--json"]
    result = runner.invoke(app, [*args, "--policy", str(DEFAULT_POLICY), "--compare", str(other)])
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout)["runs"]
    assert [Path(r["policy"]).name for r in runs] == ["default.yaml", "reboot.yaml"]
    first = runs[0]
    assert list(first["badput_s"]) == list(BADPUT)
    assert first["dominant_badput"] == max(first["badput_s"], key=first["badput_s"].get)
    assert first["params"]["gpus"] == 2048 and first["seed"] == 3
    assert first["interruptions"] == first["faults"] + first["repeats"]
    assert (
        runner.invoke(app, [*args, "--policy", str(DEFAULT_POLICY)]).stdout
        == json.dumps({"runs": [first]}, indent=2) + "\n"
    )


def test_simulate_prints_the_dominant_badput_and_writes_charts(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "simulate",
            "--gpus",
            "1024",
            "--days",
            "3",
            "--recovery",
            "meta-like",
            "--plot",
            str(tmp_path / "png"),
        ],
        env={"COLUMNS": "160"},
    )
    assert result.exit_code == 0, result.output
    assert "effective training time" in result.stdout
    assert "dominant badput" in result.stdout
    names = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert names == ["badput.png", "goodput.png", "mtbf.png", "summary.png"]
    assert all((tmp_path / "png" / n).read_bytes().startswith(b"\x89PNG") for n in names)


def test_a_save_too_slow_for_the_fleet_is_a_usage_error() -> None:
    result = runner.invoke(app, ["simulate", "--gpus", "1000000", "--days", "1", "--save-seconds", "600"])
    assert result.exit_code == 2
    assert "too slow" in result.output
