"""medic/advise.py and `medic advise checkpoint`, checked against published figures."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from medic.advise import (
    advise_checkpoint,
    human_seconds,
    job_mtbf_hours,
    observed_mtbf_hours,
    optimal_interval,
    overhead,
)
from medic.apps.cli.advise import advise_app

# Llama 3 405B pre-training (Meta, 2024): 16,384 GPUs, 419 unexpected interruptions in 54 days.
LLAMA3_MTBF_HOURS = 54 * 24 / 419
LLAMA3_SAVE_SECONDS = 2.5

runner = CliRunner()


def test_llama3_checkpoints_about_every_four_minutes_for_about_2_1_percent() -> None:
    assert observed_mtbf_hours(419, 54) == pytest.approx(LLAMA3_MTBF_HOURS)
    advice = advise_checkpoint(LLAMA3_SAVE_SECONDS, LLAMA3_MTBF_HOURS)
    assert advice.interval_seconds / 60 == pytest.approx(3.93, abs=0.01)
    assert advice.overhead == pytest.approx(0.0212, abs=0.0001)
    # At Young's optimum both costs are equal and the total is sqrt(2·δ/M).
    assert advice.save_overhead == pytest.approx(advice.rework_overhead)
    assert advice.overhead == pytest.approx(math.sqrt(2 * LLAMA3_SAVE_SECONDS / advice.job_mtbf_seconds))


@pytest.mark.parametrize(("gpus", "hours"), [(1_000, 50.0), (10_000, 5.0), (100_000, 0.5), (1_000_000, 0.05)])
def test_cluster_mtbf_shrinks_with_size(gpus: int, hours: float) -> None:
    assert job_mtbf_hours(50_000, gpus) == pytest.approx(hours)


def test_the_interval_minimises_the_overhead() -> None:
    save, mtbf = 30.0, 6 * 3600.0
    best = optimal_interval(save, mtbf)
    for factor in (0.5, 0.9, 1.1, 2.0):
        assert overhead(save, best * factor, mtbf) > overhead(save, best, mtbf)


@pytest.mark.parametrize(
    ("save", "mtbf", "message"),
    [(0.0, 3.0, "save_seconds must be a positive"), (2.5, -1.0, "mtbf_seconds"), (10.0, 4.0, "too slow")],
)
def test_nonsense_is_refused(save: float, mtbf: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        optimal_interval(save, mtbf)


def test_human_units() -> None:
    assert [human_seconds(s) for s in (42, 236, 1800, 180_000)] == ["42.0 s", "3.9 min", "30.0 min", "50.0 h"]


def test_cli_reproduces_llama3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    args = ["checkpoint", "--save-seconds", "2.5", "--gpus", "16384"]
    result = runner.invoke(advise_app, [*args, "--job-mtbf-hours", str(LLAMA3_MTBF_HOURS)])
    assert result.exit_code == 0, result.output
    assert "3.9 min" in result.output and "2.12%" in result.output

    result = runner.invoke(advise_app, [*args, "--gpu-mtbf-hours", "50000", "--json"])
    assert result.exit_code == 0, result.output
    advice = json.loads(result.output)
    assert advice["job_mtbf_seconds"] == pytest.approx(50_000 / 16_384 * 3600)
    assert advice["overhead"] == pytest.approx(advice["save_overhead"] + advice["rework_overhead"])


@pytest.mark.parametrize(
    "extra",
    [[], ["--gpu-mtbf-hours", "50000", "--job-mtbf-hours", "3"], ["--job-mtbf-hours", "0.0001"]],
)
def test_cli_rejects_bad_combinations(extra: list[str]) -> None:
    result = runner.invoke(advise_app, ["checkpoint", "--save-seconds", "2.5", "--gpus", "8", *extra])
    assert result.exit_code == 2
