"""The simulator's `measured` profile: medic/data/recovery-measured.json read, checked and put into the
model, the restart in place it adds to the loop, and `medic simulate`'s default (docs/simulate.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from checkout import REPO_ROOT
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.policy import LoadedPolicy, load_policy
from medic.whatif.fleetsim import SimParams, measured, measurement
from medic.whatif.fleetsim.failures import CAUSES, Nature
from medic.whatif.fleetsim.loop import Simulation
from medic.whatif.fleetsim.measurement import MeasurementError, RecoveryPath, parse, shipped

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"
runner = CliRunner()


@pytest.fixture(scope="module")
def default() -> LoadedPolicy:
    return load_policy(DEFAULT_POLICY)


@pytest.fixture
def document() -> dict[str, Any]:
    """The shipped file as JSON, to bend into a malformed one."""
    return json.loads(shipped().model_dump_json())  # a fresh copy each time


@pytest.fixture
def no_shipped_file(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(measurement, "MEASURED_FILE", "data/no-such-measurement.json")
    shipped.cache_clear()
    yield
    shipped.cache_clear()


def _phases(detect: float, total: float) -> dict[str, dict[str, float]]:
    return {"detect": {"p50": detect, "p95": detect}, "total": {"p50": total, "p95": total + 1}}


# --- the file -----------------------------------------------------------------------------------


def test_the_shipped_measurement_loads_with_every_path_timed() -> None:
    found = shipped()
    assert set(found.paths) == set(RecoveryPath)
    assert found.runs >= 1
    for path in RecoveryPath:
        assert 0 < found.after_detection_s(path) <= found.paths[path]["total"].p50
    # The paths the profile reads carry their own phases: torchrun in place, Slurm's requeue otherwise.
    assert "torchrun_restart" in found.paths[RecoveryPath.IN_PLACE]
    assert "schedule" in found.paths[RecoveryPath.SPARE]


def _drop_path(d: dict[str, Any]) -> None:
    del d["paths"]["spare"]


def _drop_total(d: dict[str, Any]) -> None:
    del d["paths"]["in-place"]["total"]


def _p95_below_p50(d: dict[str, Any]) -> None:
    d["paths"]["reset"]["launch"] = {"p50": 9.0, "p95": 4.0}


def _negative(d: dict[str, Any]) -> None:
    d["paths"]["no-spare"]["detect"]["p50"] = -1.0


def _unknown_path(d: dict[str, Any]) -> None:
    d["paths"]["reboot"] = d["paths"]["spare"]


def _no_runs(d: dict[str, Any]) -> None:
    d["runs"] = 0


@pytest.mark.parametrize(
    ("bend", "said"),
    [
        (_drop_path, "paths: no 'spare' path"),
        (_drop_total, "paths.in-place: no 'total' phase"),
        (_p95_below_p50, "paths.reset.launch: p95 (4.0) is below p50 (9.0)"),
        (_negative, "paths.no-spare.detect.p50: Input should be greater than or equal to 0"),
        (
            _unknown_path,
            "paths.reboot.[key]: Input should be 'in-place', 'reset', 'spare', 'no-spare' or 'hang'",
        ),
        (_no_runs, "runs: Input should be greater than or equal to 1"),
    ],
)
def test_a_malformed_measurement_is_an_error_naming_the_file_and_the_field(
    document: dict[str, Any], bend: Any, said: str
) -> None:
    bend(document)
    with pytest.raises(MeasurementError) as raised:
        parse(json.dumps(document), "recovery-measured.json")
    assert str(raised.value).startswith("recovery-measured.json: ")
    assert said in str(raised.value)


def test_a_file_that_is_not_json_is_an_error() -> None:
    with pytest.raises(MeasurementError, match=r"^recovery-measured.json: not JSON: "):
        parse("{'paths': }", "recovery-measured.json")


@pytest.mark.usefixtures("no_shipped_file")
def test_a_missing_shipped_file_says_what_writes_it() -> None:
    with pytest.raises(
        MeasurementError, match=r"missing; `PYTHONPATH=tests python -m bench.recovery` writes it"
    ):
        shipped()


# --- the profile ----------------------------------------------------------------------------------


def test_the_profile_takes_its_restarts_from_the_file_less_detection(document: dict[str, Any]) -> None:
    document["paths"]["in-place"] |= _phases(detect=0.5, total=7.0)
    document["paths"]["spare"] |= _phases(detect=1.0, total=31.0)
    document["paths"]["hang"] |= _phases(detect=50.0, total=71.0)
    params = measured(SimParams(), parse(json.dumps(document), "test"))
    assert (params.restart_in_place_s, params.restart_s) == (6.5, 30.0)
    # A hang: found from the ranks' stalls, not at the watchdog, and the job requeued onto its nodes.
    assert (params.detect_hang_s, params.restart_hung_s) == (50.0, 21.0)
    # What the cluster measured could not time stays assumed: a real server's reset, reboot, replacement.
    for kept in (
        "reset_gpu_s",
        "reboot_s",
        "replace_s",
        "detect_kernel_s",
        "detect_crash_s",
    ):
        assert getattr(params, kept) == getattr(SimParams(), kept), kept


def test_without_a_measurement_the_profile_reads_the_shipped_file() -> None:
    params = measured(SimParams(gpus=1024))
    assert params.gpus == 1024
    assert params.restart_in_place_s == shipped().after_detection_s(RecoveryPath.IN_PLACE)
    assert params.restart_s == shipped().after_detection_s(RecoveryPath.SPARE)


def test_other_profiles_restart_in_place_as_they_restart_elsewhere() -> None:
    assert SimParams().restart_in_place_s is None
    assert SimParams().in_place_restart_s == SimParams().restart_s == 300.0
    assert SimParams(restart_s=60.0).in_place_restart_s == 60.0
    assert SimParams(restart_s=60.0).hung_restart_s == 60.0  # the watchdog ends it, then torchrun


# --- the loop -------------------------------------------------------------------------------------


def _one_fault(default: LoadedPolicy, cause: str, signature: str, nature: Nature) -> dict[str, float]:
    """The badput of a day with this one fault at noon on a fleet that fails no other way."""
    params = SimParams(
        gpus=1024,
        days=1,
        gpu_mtbf_hours=1e15,
        restart_s=40.0,
        restart_in_place_s=9.0,
        restart_hung_s=20.0,
        detect_hang_s=50.0,
    )
    found = next(c for c in CAUSES if c.name == cause)
    sim = Simulation(params, default, seed=1)
    sim._push(43_200.0, 3, found, next(s for s in found.signatures if s.name == signature), nature, 0)
    report = sim.run()
    assert report.interruptions == 1
    return report.badput_s


def test_a_fault_that_leaves_the_node_in_service_costs_the_restart_in_place(default: LoadedPolicy) -> None:
    badput = _one_fault(default, "software bug", "NaN loss", Nature.RESTART)  # the policy: `none`
    assert badput["recovery"] == pytest.approx(9.0)


def test_a_hang_on_a_node_that_stays_costs_its_detection_and_the_requeue_onto_its_nodes(
    default: LoadedPolicy,
) -> None:
    badput = _one_fault(default, "NCCL watchdog timeout", "collective timeout", Nature.RESTART)  # L1 passes
    assert (badput["detection"], badput["recovery"]) == (pytest.approx(50.0), pytest.approx(20.0))


def test_a_node_taken_out_costs_the_requeue_onto_a_spare(default: LoadedPolicy) -> None:
    badput = _one_fault(default, "faulty GPU", "XID 79 fallen off the bus", Nature.REBOOT)  # a reboot
    assert badput["recovery"] == pytest.approx(40.0)  # a spare was free at once: no wait


# --- the command ----------------------------------------------------------------------------------


def _params(*options: str) -> dict[str, Any]:
    result = runner.invoke(app, ["simulate", "--gpus", "1024", "--days", "2", "--json", *options])
    assert result.exit_code == 0, result.output
    run: dict[str, Any] = json.loads(result.stdout)["runs"][0]
    return run


def test_medic_simulate_defaults_to_the_measured_profile() -> None:
    run = _params()
    assert run == _params("--recovery", "measured")
    assert run["params"]["restart_in_place_s"] == shipped().after_detection_s(RecoveryPath.IN_PLACE)
    assert run["params"]["restart_s"] == shipped().after_detection_s(RecoveryPath.SPARE)
    assert run["params"]["detect_hang_s"] == shipped().detection_s(RecoveryPath.HANG)  # not the watchdog
    assert run["params"]["restart_hung_s"] == shipped().after_detection_s(RecoveryPath.HANG)


def test_the_assumed_durations_stay_reachable_as_recovery_medic() -> None:
    params = _params("--recovery", "medic")["params"]
    assert params["restart_s"] == 300.0 and params["detect_hang_s"] == 600.0
    assert params["restart_in_place_s"] is None  # restarts in place as it restarts elsewhere
    # The Llama 3 run under the assumed durations, as docs/simulate.md shows it beside the measured one.
    result = runner.invoke(
        app, ["simulate", "--recovery", "medic", "--seed", "1", "--policy", str(DEFAULT_POLICY), "--json"]
    )
    assert json.loads(result.stdout)["runs"][0]["goodput"] == pytest.approx(0.9326, abs=5e-5)


@pytest.mark.usefixtures("no_shipped_file")
def test_a_broken_measurement_stops_medic_simulate_with_the_reason() -> None:
    result = runner.invoke(app, ["simulate", "--gpus", "1024", "--days", "1"])
    assert result.exit_code == 2
    assert "no-such-measurement.json: missing" in result.output
    assumed = runner.invoke(app, ["simulate", "--gpus", "1024", "--days", "1", "--recovery", "medic"])
    assert assumed.exit_code == 0  # the file is read only for the profile that needs it
