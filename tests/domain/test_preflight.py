"""medic/preflight.py: the prolog's quick checks judged on NVML's answers, on `nvidia-smi -q`
recorded on real GPUs (tests/fixtures/nvml/SOURCES.md) and on answers made for one case each; the
drain reason; and what GPU Medic's default policy decides on the events a failed preflight sends."""

from __future__ import annotations

from dataclasses import replace

import pytest
from checkout import REPO_ROOT
from nvidia_smi import node, recorded

from medic.apps.hooks import preflight_events
from medic.events import EventKind
from medic.facts import facts_of
from medic.incidents import correlate
from medic.policy import decide, load_policy
from medic.preflight import (
    MAX_REASON_CHARS,
    REMAP_FIELD,
    RETIRED_FIELD,
    Failure,
    GpuAnswers,
    NodeAnswers,
    Verdict,
    agent_events,
    dcgm_timeout,
    drain_reason,
    judge,
    judge_unavailable,
    no_time_for,
    overrun,
)

H100_NODE = "h100-sxm-x8-565.57.01.txt"


def healthy(index: int, **changes: object) -> GpuAnswers:
    """A GPU as the recorded H100s answered, with `changes`."""
    gpu = node(recorded(H100_NODE)).gpus[0]
    return replace(gpu, index=index, **changes)


def node_of(*gpus: GpuAnswers, count: int | None = None) -> NodeAnswers:
    return NodeAnswers(len(gpus) if count is None else count, gpus)


def checks(verdict: Verdict) -> list[tuple[str, int | None]]:
    return [(f.check, f.gpu) for f in verdict.failures]


# -- recorded on real GPUs ----------------------------------------------------------------------


def test_a_recorded_healthy_h100_node_passes_and_says_what_hopper_does_not_support() -> None:
    verdict = judge(node(recorded(H100_NODE)), expected_gpus=8)
    assert verdict.passed
    # Hopper has no page retirement: NVML answers NotSupported, nvidia-smi prints N/A.
    assert verdict.unsupported == tuple(f"GPU {i}: {RETIRED_FIELD} not supported" for i in range(8))


def test_a_recorded_a100_with_a_row_remap_pending_fails() -> None:
    verdict = judge(node(recorded("a100-row-remap-pending-510.73.08.txt")), expected_gpus=None)
    # The excerpt shows only the memory sections: the other checks have nothing to judge here.
    memory = [f for f in verdict.failures if f.check in ("row_remap", "retired_pages", "ecc")]
    assert [f.describe() for f in memory] == [
        "row_remap: GPU 0: row remap pending: the GPU must be reset before the row is replaced"
    ]
    assert memory[0].facts == {"row_remap_pending": True, "row_remap_failure": False}
    assert verdict.unsupported == (f"GPU 0: {RETIRED_FIELD} not supported",)


def test_a_recorded_pending_page_retirement_fails() -> None:
    verdict = judge(node(recorded("retired-pages-pending.txt")), expected_gpus=None)
    [failure] = [f for f in verdict.failures if f.check == "retired_pages"]
    assert failure.detail == "GPU 0: page retirement pending: the GPU must be reset to retire them"
    assert (failure.kind, failure.facts) == (EventKind.ECC, {"retired_pages_pending": True})


def test_a_recorded_uncorrectable_sram_error_since_the_driver_loaded_fails() -> None:
    verdict = judge(node(recorded("sram-uncorrectable-volatile.txt")), expected_gpus=None)
    [failure] = [f for f in verdict.failures if f.check == "ecc"]
    assert failure.detail == "GPU 0: 1 uncorrectable ECC errors since the driver loaded"
    assert failure.facts == {"dbe": 1, "counter": "volatile"}


# -- one case each ------------------------------------------------------------------------------


def test_fewer_gpus_than_expected() -> None:
    verdict = judge(node_of(*(healthy(i) for i in range(7))), expected_gpus=8)
    [failure] = verdict.failures
    assert failure.describe() == "gpu_count: 7 GPUs visible, 8 expected"
    assert (failure.kind, failure.facts) == (
        EventKind.GPU_MISSING,
        {"expected": 8, "found": 7, "lost_gpus": []},
    )


def test_more_gpus_than_expected_is_a_setting_to_fix_not_a_gpu_to_repair() -> None:
    verdict = judge(node_of(*(healthy(i) for i in range(8))), expected_gpus=4)
    [failure] = verdict.failures
    assert (failure.describe(), failure.kind) == ("gpu_count: 8 GPUs visible, 4 expected", None)


def test_no_expected_count_checks_no_count() -> None:
    assert judge(node_of(healthy(0)), expected_gpus=None).passed


def test_a_lost_gpu_is_named_with_nvmls_words() -> None:
    gpus = [healthy(i) for i in range(8)]
    gpus[5] = GpuAnswers(5, lost="GPU is lost")
    verdict = judge(node_of(*gpus), expected_gpus=8)
    [failure] = verdict.failures
    assert failure.describe() == "gpu_lost: GPU 5: GPU is lost"
    assert failure.facts == {"expected": 8, "found": 7, "lost_gpus": [5]}


@pytest.mark.parametrize(
    ("changes", "failed"),
    [
        (
            {"row_remap": (True, True)},
            "row_remap: GPU 2: row remapping failed: no spare row was left for a failing one",
        ),
        (
            {"clock_reasons": ("gpu_idle", "hw_slowdown")},
            "clocks: GPU 2: clocks slowed while idle: hw_slowdown",
        ),
        (
            {"clock_reasons": ("gpu_idle", "hw_thermal_slowdown", "sw_thermal_slowdown")},
            "clocks: GPU 2: clocks slowed while idle: hw_thermal_slowdown, sw_thermal_slowdown",
        ),
        (
            {"clock_reasons": ("gpu_idle", "hw_power_brake_slowdown")},
            "clocks: GPU 2: clocks slowed while idle: hw_power_brake_slowdown",
        ),
        ({"persistence_mode": False}, "persistence_mode: GPU 2: persistence mode is off"),
    ],
)
def test_each_check_fails_with_its_reason(changes: dict[str, object], failed: str) -> None:
    verdict = judge(node_of(healthy(2, **changes)), expected_gpus=None)
    assert [f.describe() for f in verdict.failures] == [failed]


def test_a_power_cap_or_application_clocks_are_settings_not_faults() -> None:
    gpu = healthy(0, clock_reasons=("gpu_idle", "sw_power_cap", "applications_clocks_setting", "sync_boost"))
    assert judge(node_of(gpu), expected_gpus=None).passed


def test_a_gpu_another_job_keeps_busy_is_not_judged_by_its_clocks() -> None:
    gpu = healthy(0, clock_reasons=("sw_thermal_slowdown",))  # no gpu_idle: under load
    assert judge(node_of(gpu), expected_gpus=None).passed


def test_an_unreadable_answer_fails_closed_and_says_why() -> None:
    gpu = healthy(3, row_remap=None, errors={REMAP_FIELD: "Unknown Error"}, persistence_mode=None)
    verdict = judge(node_of(gpu), expected_gpus=None)
    assert [f.describe() for f in verdict.failures] == [
        "row_remap: GPU 3: remapped rows unreadable (Unknown Error)",
        # None with no error and not NotSupported: no permission, say. Still no pass.
        "persistence_mode: GPU 3: persistence mode unreadable (no answer)",
    ]


def test_not_supported_is_never_a_failure() -> None:
    # A GeForce board: no ECC, no page retirement, no row remapping.
    unsupported = frozenset({"ecc volatile uncorrected", RETIRED_FIELD, REMAP_FIELD})
    gpu = healthy(0, ecc_volatile_uncorrected=None, row_remap=None, unsupported=unsupported)
    verdict = judge(node_of(gpu), expected_gpus=1)
    assert verdict.passed
    assert len(verdict.unsupported) == 3


@pytest.mark.parametrize(("expected", "passed"), [(0, True), (8, False), (None, False)])
def test_no_nvml_passes_only_where_no_gpus_are_expected(expected: int | None, passed: bool) -> None:
    verdict = judge_unavailable("NVML: Driver Not Loaded", expected)
    assert verdict.passed is passed
    if not passed:
        assert checks(verdict) == [("nvml", None)]


# -- the budget ---------------------------------------------------------------------------------


def test_dcgm_gets_what_is_left_of_the_budget_less_the_time_to_stop_it() -> None:
    assert dcgm_timeout(30.0, 0.05, 5.0) == pytest.approx(24.95)
    assert dcgm_timeout(5.0, 0.5, 5.0) < 0  # no time left to start it


def test_overruns_say_what_ran_out_of_time() -> None:
    assert overrun("DCGM level 1", 24.96, 30).describe() == (
        "budget: DCGM level 1 did not finish within 25.0 s of the 30 s budget"
    )
    assert no_time_for("DCGM level 1", 4.2, 5).describe() == (
        "budget: 4.2 s of the 5 s budget spent before DCGM level 1 could start"
    )


# -- what a failed preflight says ---------------------------------------------------------------


def test_the_drain_reason_names_the_most_basic_failure_first_and_counts_the_rest() -> None:
    failures = [
        Failure("persistence_mode", "GPU 1: persistence mode is off", 1),
        Failure("row_remap", "GPU 6: row remapping failed: no spare row was left for a failing one", 6),
        Failure("gpu_count", "7 GPUs visible, 8 expected"),
    ]
    assert drain_reason(failures) == "medic: preflight gpu_count: 7 GPUs visible, 8 expected (+2 more)"


def test_a_long_reason_is_cut_to_what_people_read() -> None:
    reason = drain_reason([Failure("dcgm_l1", "x" * 500), Failure("budget", "y")])
    assert reason == "medic: preflight budget: y (+1 more)"
    long_first = drain_reason([Failure("nvml", "z" * 500), Failure("budget", "y")])
    assert (len(long_first), long_first.endswith("zzz... (+1 more)")) == (MAX_REASON_CHARS, True)


def test_findings_become_the_events_the_agent_sends_one_per_kind_and_gpu() -> None:
    gpus = [healthy(i) for i in range(8)]
    gpus[1] = GpuAnswers(1, lost="GPU is lost")
    gpus[3] = healthy(3, row_remap=(True, False), ecc_volatile_uncorrected=2, persistence_mode=False)
    verdict = judge(node_of(*gpus), expected_gpus=9)
    assert agent_events(verdict.failures) == [
        (EventKind.GPU_MISSING, None, {"expected": 9, "found": 7, "lost_gpus": [1]}),
        (
            EventKind.ECC,
            3,
            {"row_remap_pending": True, "row_remap_failure": False, "dbe": 2, "counter": "volatile"},
        ),
    ]


POLICY = load_policy(REPO_ROOT / "policies" / "default.yaml")


@pytest.mark.parametrize(
    ("changes", "action", "rule"),
    [
        ({"row_remap": (False, True)}, "replace", "row-remap-failure"),
        ({"row_remap": (True, False)}, "reset_gpu", "row-remap-pending"),
        ({"ecc_volatile_uncorrected": 3}, "reset_gpu", "ecc-double-bit"),
        ({"lost": "GPU is lost"}, "reboot", "gpu-missing"),
        # No rule acts on a setting: the node stays drained for an SRE (docs/agent.md).
        ({"persistence_mode": False}, "none", "default"),
    ],
)
def test_gpu_medic_decides_on_a_failed_preflight_as_on_the_agents_report(
    changes: dict[str, object], action: str, rule: str
) -> None:
    gpus = [healthy(i) for i in range(8)]
    gpus[4] = healthy(4, **changes)
    verdict = judge(node_of(*gpus), expected_gpus=8)
    env = {"SLURM_JOB_ID": "4242"}
    events = preflight_events(verdict.failures, "gpu-node-3", env, drained="medic: preflight ...")
    assert events[0].attributes["check"] == "preflight"
    [incident] = correlate(events)
    # The prolog drained the node with a `medic:` reason: GPU Medic sees it out of service by us.
    decision = decide(POLICY.policy, facts_of(incident, out_of_service=True), POLICY.sha256)
    assert (decision.action.value, decision.rule) == (action, rule)
