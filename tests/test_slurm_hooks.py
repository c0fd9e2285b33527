"""medic/hooks.py and deployments/slurm/medic-*.sh against the fake `dcgmi` of
tests/fixtures/dcgm/fake_dcgmi.sh; the scripts run as Slurm runs them: no PATH, almost no environment."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from medic.config import REPO_ROOT
from medic.events import EventKind, FaultEvent
from medic.hooks import job_failed, main, run_hook

FIXTURES = Path(__file__).parent / "fixtures" / "dcgm"
SCRIPTS = REPO_ROOT / "deployments" / "slurm"
NODE = "gpu-node-7"


class Dcgmi:
    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "bin" / "dcgmi"
        self.path.parent.mkdir()
        shutil.copy(FIXTURES / "fake_dcgmi.sh", self.path)
        self.path.chmod(self.path.stat().st_mode | stat.S_IXUSR)
        self.args = tmp_path / "dcgmi-args"
        self.events = tmp_path / "events.jsonl"

    def env(self, mode: str, fixture: str | None = None, **extra: str) -> dict[str, str]:
        """The settings a site would give the hooks, for a fake dcgmi in `mode`."""
        env = {
            "MEDIC_DCGMI": str(self.path),
            "MEDIC_EVENTS_FILE": str(self.events),
            "FAKE_DCGMI_MODE": mode,
            "FAKE_DCGMI_ARGS": str(self.args),
            "SLURMD_NODENAME": NODE,
            "SLURM_JOB_ID": "4242",
        }
        if fixture:
            env["FAKE_DCGMI_FIXTURE"] = str(FIXTURES / fixture)
        return env | extra

    def ran(self) -> list[str] | None:
        return self.args.read_text().split() if self.args.exists() else None

    def written(self) -> list[FaultEvent]:
        if not self.events.exists():
            return []
        return [FaultEvent.model_validate_json(line) for line in self.events.read_text().splitlines()]


@pytest.fixture
def dcgmi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Dcgmi:
    return Dcgmi(tmp_path)


def hook(dcgmi: Dcgmi, monkeypatch: pytest.MonkeyPatch, phase: str, env: dict[str, str]) -> int:
    # dcgmi inherits this process's environment: the fake reads its mode from there.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return run_hook(phase, env)


@pytest.mark.parametrize(
    ("env", "failed"),
    [
        ({"SLURM_JOB_EXIT_CODE2": "0:0"}, False),
        ({"SLURM_JOB_EXIT_CODE2": "1:0"}, True),
        ({"SLURM_JOB_EXIT_CODE2": "0:9"}, True),  # killed by a signal
        ({"SLURM_JOB_EXIT_CODE": "0"}, False),
        ({"SLURM_JOB_EXIT_CODE": "256"}, True),  # wait(2) status of exit 1
        ({"SLURM_JOB_EXIT_CODE2": "garbled", "SLURM_JOB_EXIT_CODE": "0"}, False),
        ({}, None),
    ],
)
def test_job_failed(env: dict[str, str], failed: bool | None) -> None:
    assert job_failed(env) is failed


def test_prolog_runs_level_1_and_reports_a_pass(dcgmi: Dcgmi, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hook(dcgmi, monkeypatch, "prolog", dcgmi.env("fixture", "l1_pass.json")) == 0
    assert dcgmi.ran() == ["diag", "-r", "1", "-j"]
    [event] = dcgmi.written()
    assert (event.kind, event.node, event.job, event.source) == (EventKind.DIAGNOSTIC, NODE, "4242", "slurm")
    assert event.attributes["level"] == 1
    assert (event.attributes["result"], event.attributes["error_ids"], event.attributes["phase"]) == (
        "pass",
        [],
        "prolog",
    )


def test_a_failed_prolog_diagnostic_is_reported_and_fails_open(
    dcgmi: Dcgmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = dcgmi.env("fixture", "l2_memory_faulty.json", FAKE_DCGMI_RC="205")
    assert hook(dcgmi, monkeypatch, "prolog", env) == 0
    diagnostic, check = dcgmi.written()
    assert (diagnostic.kind, diagnostic.attributes["result"], diagnostic.attributes["error_ids"]) == (
        EventKind.DIAGNOSTIC,
        "fail",
        ["DCGM_FR_FAULTY_MEMORY"],
    )
    assert (check.kind, check.attributes["phase"], check.attributes["check"]) == (
        EventKind.HEALTH_CHECK,
        "prolog",
        "dcgm_diag",
    )
    assert "DCGM_FR_FAULTY_MEMORY" in check.attributes["message"]


def test_fail_closed_prolog_exits_non_zero(dcgmi: Dcgmi, monkeypatch: pytest.MonkeyPatch) -> None:
    env = dcgmi.env("fixture", "l2_memory_faulty.json", FAKE_DCGMI_RC="205", MEDIC_PROLOG_FAIL_CLOSED="1")
    assert hook(dcgmi, monkeypatch, "prolog", env) == 1


def test_a_diagnostic_that_cannot_run_is_a_health_check_and_never_fails_the_hook(
    dcgmi: Dcgmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = dcgmi.env("hostengine-down", MEDIC_PROLOG_FAIL_CLOSED="1")
    assert hook(dcgmi, monkeypatch, "prolog", env) == 0
    [check] = dcgmi.written()  # no verdict about the GPUs: no diagnostic event
    assert (check.kind, check.attributes["result"], check.attributes["check"]) == (
        EventKind.HEALTH_CHECK,
        "error",
        "dcgm_diag",
    )
    assert "nv-hostengine is not reachable" in check.attributes["message"]


def test_epilog_after_a_successful_job_runs_nothing(dcgmi: Dcgmi, monkeypatch: pytest.MonkeyPatch) -> None:
    env = dcgmi.env("fixture", "l2_pass.json", SLURM_JOB_EXIT_CODE2="0:0")
    assert hook(dcgmi, monkeypatch, "epilog", env) == 0
    assert (dcgmi.ran(), dcgmi.written()) == (None, [])


def test_epilog_after_a_failed_job_runs_level_2_and_never_fails(
    dcgmi: Dcgmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = dcgmi.env("fixture", "l2_pcie.json", FAKE_DCGMI_RC="205", SLURM_JOB_EXIT_CODE2="1:0")
    env["MEDIC_PROLOG_FAIL_CLOSED"] = "1"  # applies to the prolog only
    assert hook(dcgmi, monkeypatch, "epilog", env) == 0
    assert dcgmi.ran() == ["diag", "-r", "2", "-j"]
    diagnostic, check = dcgmi.written()
    assert (diagnostic.attributes["level"], diagnostic.attributes["result"], diagnostic.attributes["phase"]) == (
        2,
        "fail",
        "epilog",
    )
    assert check.attributes["phase"] == "epilog"


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reboot"]) == 2
    assert "prolog|epilog|healthcheck" in capsys.readouterr().err


# -- the scripts, as Slurm starts them ----------------------------------------------------------


@pytest.fixture
def installed(tmp_path: Path, dcgmi: Dcgmi) -> Path:
    """The hook scripts copied to a directory of their own, as a site installs them."""
    where = tmp_path / "etc-slurm"
    where.mkdir()
    for script in SCRIPTS.glob("medic-*.sh"):
        shutil.copy2(script, where)
    return where


def settings(where: Path, values: dict[str, str]) -> None:
    lines = [f"{name}={shlex_quote(value)}" for name, value in values.items()]
    (where / "medic-hooks.env").write_text("\n".join(lines) + "\n")


def shlex_quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def slurm_run(script: Path, **slurm_env: str) -> subprocess.CompletedProcess[str]:
    """Run a hook with only what slurmd gives it: no PATH, a few SLURM_* variables."""
    return subprocess.run(
        ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in slurm_env.items()), str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )


def test_epilog_script_runs_with_no_path(installed: Path, dcgmi: Dcgmi) -> None:
    env = dcgmi.env("fixture", "l2_memory_faulty.json", FAKE_DCGMI_RC="205", MEDIC_PYTHON=sys.executable)
    settings(installed, {k: v for k, v in env.items() if not k.startswith("SLURM")})
    done = slurm_run(installed / "medic-epilog.sh", SLURMD_NODENAME=NODE, SLURM_JOB_ID="77", SLURM_JOB_EXIT_CODE2="0:6")
    assert done.returncode == 0, done.stderr
    assert dcgmi.ran() == ["diag", "-r", "2", "-j"]
    diagnostic, check = dcgmi.written()
    assert (diagnostic.node, diagnostic.job, diagnostic.attributes["result"]) == (NODE, "77", "fail")
    assert check.attributes["phase"] == "epilog"


def test_prolog_and_healthcheck_scripts(installed: Path, dcgmi: Dcgmi) -> None:
    env = dcgmi.env(
        "fixture", "l2_memory_faulty.json", FAKE_DCGMI_RC="205", MEDIC_PYTHON=sys.executable, MEDIC_PROLOG_FAIL_CLOSED="1"
    )
    settings(installed, {k: v for k, v in env.items() if not k.startswith("SLURM")})
    prolog = slurm_run(installed / "medic-prolog.sh", SLURMD_NODENAME=NODE, SLURM_JOB_ID="78")
    assert prolog.returncode == 1
    assert f"DCGM level 1 failed on {NODE}" in prolog.stderr
    healthcheck = slurm_run(installed / "medic-healthcheck.sh", SLURMD_NODENAME=NODE)
    assert healthcheck.returncode == 0  # only the prolog fails closed
    phases = [(e.kind, e.attributes["phase"]) for e in dcgmi.written()]
    assert phases == [
        (EventKind.DIAGNOSTIC, "prolog"),
        (EventKind.HEALTH_CHECK, "prolog"),
        (EventKind.DIAGNOSTIC, "healthcheck"),
        (EventKind.HEALTH_CHECK, "healthcheck"),
    ]


def test_a_script_that_finds_no_python_fails_open(installed: Path, dcgmi: Dcgmi) -> None:
    settings(installed, {"MEDIC_PYTHON": str(installed / "no-such-python")})
    done = slurm_run(installed / "medic-prolog.sh", SLURMD_NODENAME=NODE)
    assert done.returncode == 0
    assert "no-such-python" in done.stderr
    assert dcgmi.ran() is None
