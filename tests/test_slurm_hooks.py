"""apps/hooks.py and deployments/slurm/medic-*.sh against the fake `dcgmi` of
tests/fixtures/dcgm/fake_dcgmi.sh: in process, as Slurm starts the scripts (no PATH, almost no
environment), and from a real one-node Slurm cluster's Prolog and Epilog."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from apps.hooks import FAIL_CLOSED, job_failed, main, run_hook
from medic.config import REPO_ROOT
from medic.events import EventKind, FaultEvent

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
def dcgmi(tmp_path: Path) -> Dcgmi:
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
    assert hook(dcgmi, monkeypatch, "prolog", env) == FAIL_CLOSED


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
    assert (
        diagnostic.attributes["level"],
        diagnostic.attributes["result"],
        diagnostic.attributes["phase"],
    ) == (
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
    lines = [f"{name}={shlex.quote(value)}" for name, value in values.items()]
    (where / "medic-hooks.env").write_text("\n".join(lines) + "\n")


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
    done = slurm_run(
        installed / "medic-epilog.sh", SLURMD_NODENAME=NODE, SLURM_JOB_ID="77", SLURM_JOB_EXIT_CODE2="0:6"
    )
    assert done.returncode == 0, done.stderr
    assert dcgmi.ran() == ["diag", "-r", "2", "-j"]
    diagnostic, check = dcgmi.written()
    assert (diagnostic.node, diagnostic.job, diagnostic.attributes["result"]) == (NODE, "77", "fail")
    assert check.attributes["phase"] == "epilog"


def test_prolog_and_healthcheck_scripts(installed: Path, dcgmi: Dcgmi) -> None:
    env = dcgmi.env(
        "fixture",
        "l2_memory_faulty.json",
        FAKE_DCGMI_RC="205",
        MEDIC_PYTHON=sys.executable,
        MEDIC_PROLOG_FAIL_CLOSED="1",
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


@pytest.mark.parametrize(
    ("python", "complaint"),
    [
        ("/nonexistent/python", "no Python at '/nonexistent/python'"),
        (
            "/usr/bin/python3",
            "/usr/bin/python3 -m apps.hooks exited 1; not failing the prolog",
        ),  # no GPU Medic
    ],
)
def test_a_hook_that_cannot_run_fails_open(
    installed: Path, dcgmi: Dcgmi, python: str, complaint: str
) -> None:
    settings(installed, {"MEDIC_PYTHON": python, "MEDIC_PROLOG_FAIL_CLOSED": "1"})
    done = slurm_run(installed / "medic-prolog.sh", SLURMD_NODENAME=NODE)
    assert done.returncode == 0
    assert complaint in done.stderr
    assert dcgmi.ran() is None


# -- a real Slurm runs the scripts ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def until(check: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {within_s:.0f} s")
        time.sleep(0.1)


@pytest.fixture
def slurm(dcgmi: Dcgmi) -> Iterator[Path]:
    """A one-node Slurm cluster (scripts/slurm-cluster.sh) whose Prolog and Epilog are our scripts.
    Yields the directory they are installed in."""
    if shutil.which("slurmctld") is None:
        subprocess.run([str(REPO_ROOT / "scripts" / "install-slurm.sh")], check=True, timeout=600)
    # Not under pytest's tmp_path: munged wants every directory above its socket searchable by all.
    base = Path(tempfile.mkdtemp(prefix="medic-slurm-hooks-"))
    base.chmod(0o755)
    env = {
        **os.environ,
        "SLURM_TEST_BASE": str(base),
        "SLURM_TEST_NODES": "1",
        "SLURM_TEST_GPUS": "0",
        "SLURM_TEST_CTLD_PORT": str(free_port()),
        "SLURM_TEST_NODE_PORT0": str(free_port() - 1),  # node 1 listens on PORT0 + 1
    }
    script = str(REPO_ROOT / "scripts" / "slurm-cluster.sh")
    subprocess.run([script, "start"], env=env, check=True, timeout=120, capture_output=True)
    try:
        hooks = base / "hooks"
        hooks.mkdir()
        for hook_script in SCRIPTS.glob("medic-*.sh"):
            shutil.copy2(hook_script, hooks)
        conf = base / "etc" / "slurm.conf"
        with conf.open("a") as f:
            f.write(f"Prolog={hooks}/medic-prolog.sh\nEpilog={hooks}/medic-epilog.sh\n")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SLURM_CONF", str(conf))
            subprocess.run(["scontrol", "reconfigure"], check=True, timeout=30)
            yield hooks
    finally:
        subprocess.run([script, "stop"], env=env, check=True, timeout=120, capture_output=True)
        shutil.rmtree(base)


def sbatch(command: str) -> str:
    done = subprocess.run(
        ["sbatch", "--parsable", "--chdir=/tmp", "--output=/dev/null", "--wrap", command],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return done.stdout.strip()


def node_state() -> tuple[str, str]:
    done = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%t|%E"], capture_output=True, text=True, check=True, timeout=30
    )
    state, _, reason = done.stdout.strip().partition("|")
    return state, reason


@pytest.mark.system
def test_slurm_runs_the_hooks(slurm: Path, dcgmi: Dcgmi) -> None:
    env = dcgmi.env("fixture", "l2_pass.json", MEDIC_PYTHON=sys.executable)
    settings(slurm, {k: v for k, v in env.items() if not k.startswith("SLURM")})
    failing = sbatch("exit 3")
    until(lambda: len(dcgmi.written()) == 2, "prolog and epilog events")
    prolog, epilog = dcgmi.written()
    assert (prolog.job, prolog.node, prolog.attributes["phase"], prolog.attributes["level"]) == (
        failing,
        "gpu-node-1",
        "prolog",
        1,
    )
    assert (epilog.job, epilog.attributes["phase"], epilog.attributes["level"]) == (failing, "epilog", 2)

    # Fail closed: Slurm drains the node and holds the job for a requeue.
    env |= {"FAKE_DCGMI_FIXTURE": str(FIXTURES / "l2_memory_faulty.json"), "MEDIC_PROLOG_FAIL_CLOSED": "1"}
    settings(slurm, {k: v for k, v in env.items() if not k.startswith("SLURM")})
    refused = sbatch("true")
    until(lambda: node_state()[0] == "drain", "the node to drain")
    assert node_state() == ("drain", "Prolog error")
    diagnostic, check = dcgmi.written()[2:]
    assert (diagnostic.job, diagnostic.attributes["result"], check.attributes["check"]) == (
        refused,
        "fail",
        "dcgm_diag",
    )
