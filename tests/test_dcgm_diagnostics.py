"""DcgmDiagnostics and the runners against a fake `dcgmi` executable (tests/fixtures/dcgm/fake_dcgmi.sh).

The fake stands in for NVIDIA's binary only: the process handling, the timeout kill and the
parsing under test are the real ones.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from integrations.dcgm import runner
from integrations.dcgm.diagnostics import DcgmDiagnostics
from integrations.dcgm.runner import (
    LocalRunner,
    RunnerConfigError,
    SrunRunner,
    SshRunner,
    run_process,
    runner_from_env,
)
from medic.protocols import DiagnosticResult, Diagnostics

FIXTURES = Path(__file__).parent / "fixtures" / "dcgm"
NODE = "gpu-node-07"
GRACE_S = 0.2


@dataclass
class FakeDcgmi:
    bin: Path
    args_file: Path
    pids_file: Path
    monkeypatch: pytest.MonkeyPatch

    def mode(self, mode: str, fixture: str | None = None, rc: int = 0) -> None:
        self.monkeypatch.setenv("FAKE_DCGMI_MODE", mode)
        self.monkeypatch.setenv("FAKE_DCGMI_RC", str(rc))
        if fixture:
            self.monkeypatch.setenv("FAKE_DCGMI_FIXTURE", str(FIXTURES / fixture))

    def pids(self) -> list[int]:
        return [int(p) for p in self.pids_file.read_text().split()]


def install(directory: Path, name: str, script: str) -> None:
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeDcgmi:
    bin_dir = tmp_path / "bin"
    install(bin_dir, "dcgmi", (FIXTURES / "fake_dcgmi.sh").read_text())
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    args, pids = tmp_path / "args", tmp_path / "pids"
    monkeypatch.setenv("FAKE_DCGMI_ARGS", str(args))
    monkeypatch.setenv("FAKE_DCGMI_PIDS", str(pids))
    return FakeDcgmi(bin_dir, args, pids, monkeypatch)


@pytest.fixture
def diagnostics() -> DcgmDiagnostics:
    return DcgmDiagnostics(LocalRunner(aliases=[NODE], term_grace_s=GRACE_S))


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that never reaps it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], within_s: float = 2.0) -> bool:
    # An orphaned grandchild is reaped by init a moment after the kill.
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_is_a_diagnostics_backend(diagnostics: DcgmDiagnostics) -> None:
    assert isinstance(diagnostics, Diagnostics)


def test_pass_runs_dcgmi_diag_at_the_level_in_json(fake: FakeDcgmi, diagnostics: DcgmDiagnostics) -> None:
    fake.mode("fixture", "l2_pass.json")
    result = diagnostics.run(NODE, 2, timeout_s=30)
    assert fake.args_file.read_text().split() == ["diag", "-r", "2", "-j"]
    assert (result.node, result.level, result.result, result.error_ids) == (NODE, 2, "pass", ())
    assert result.detail == f"DCGM level 2 pass on {NODE}: 3 tests on 8 GPUs (software, memory, pcie)"
    assert result.started_at is not None and result.finished_at is not None
    assert result.started_at <= result.finished_at


@pytest.mark.parametrize(
    ("fixture", "level", "rc", "error_ids", "in_detail"),
    [
        # dcgmi's exit status for failed tests: DCGM_ST_NVVS_ISOLATE_ERROR (-51), DCGM_ST_NVVS_ERROR (-30)
        (
            "l2_memory_faulty.json",
            2,
            205,
            ("DCGM_FR_FAULTY_MEMORY",),
            "GPU 3 memory DCGM_FR_FAULTY_MEMORY (ISOLATE)",
        ),
        (
            "l2_pcie.json",
            2,
            205,
            ("DCGM_FR_PCIE_GENERATION", "DCGM_FR_PCI_REPLAY_RATE"),
            "GPU 5 pcie DCGM_FR_PCI_REPLAY_RATE (ISOLATE): Detected more than 8 PCIe replays",
        ),
        ("l3_nvlink.json", 3, 205, ("DCGM_FR_NVLINK_ERROR_THRESHOLD",), "GPU 6 diagnostic"),
        (
            "l3_thermal.json",
            3,
            226,
            ("DCGM_FR_TEMP_VIOLATION",),
            "GPU 1 targeted_power DCGM_FR_TEMP_VIOLATION",
        ),
    ],
)
def test_failed_tests_are_a_fail_with_dcgm_error_names(
    fake: FakeDcgmi,
    diagnostics: DcgmDiagnostics,
    fixture: str,
    level: int,
    rc: int,
    error_ids: tuple[str, ...],
    in_detail: str,
) -> None:
    fake.mode("fixture", fixture, rc=rc)
    result = diagnostics.run(NODE, level, timeout_s=30)
    assert (result.result, result.error_ids) == ("fail", error_ids)
    assert in_detail in result.detail


def expect_error(result: DiagnosticResult, *fragments: str) -> None:
    assert result.result == "error", result
    assert result.error_ids == ()
    for fragment in fragments:
        assert fragment in result.detail, result.detail


def test_dcgm_runtime_error(fake: FakeDcgmi, diagnostics: DcgmDiagnostics) -> None:
    fake.mode("fixture", "runtime_error.json", rc=203)
    expect_error(diagnostics.run(NODE, 1, 30), "DCGM reported a runtime error", "killed by a signal")


def test_truncated_output(fake: FakeDcgmi, diagnostics: DcgmDiagnostics) -> None:
    fake.mode("fixture", "l2_truncated.json")
    expect_error(diagnostics.run(NODE, 2, 30), "dcgmi output unusable (truncated JSON")


def test_output_that_is_not_json(fake: FakeDcgmi, diagnostics: DcgmDiagnostics) -> None:
    fake.mode("garbage")
    expect_error(diagnostics.run(NODE, 1, 30), "dcgmi output unusable (not JSON")


def test_partial_results_below_the_requested_level(fake: FakeDcgmi, diagnostics: DcgmDiagnostics) -> None:
    fake.mode("fixture", "l2_pass.json")
    expect_error(
        diagnostics.run(NODE, 3, 30), "partial results, only level-2 tests ran (software, memory, pcie)"
    )


def test_hostengine_down(fake: FakeDcgmi, diagnostics: DcgmDiagnostics) -> None:
    fake.mode("hostengine-down")
    expect_error(
        diagnostics.run(NODE, 1, 30),
        f"nv-hostengine is not reachable on {NODE}",
        "Unable to connect to host engine",
    )


def test_dcgmi_that_cannot_run_exits_127(fake: FakeDcgmi, diagnostics: DcgmDiagnostics) -> None:
    fake.mode("broken-install")
    expect_error(diagnostics.run(NODE, 1, 30), f"dcgmi not found on {NODE}", "libdcgm.so.4")


def test_dcgmi_not_installed(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-dcgm" / "dcgmi")
    backend = DcgmDiagnostics(LocalRunner(aliases=[NODE]), dcgmi=missing)
    expect_error(backend.run(NODE, 1, 30), "could not start", "No such file or directory")


def test_hang_is_killed_at_the_timeout(fake: FakeDcgmi, diagnostics: DcgmDiagnostics) -> None:
    fake.mode("hang")
    started = time.monotonic()
    result = diagnostics.run(NODE, 4, timeout_s=1)
    elapsed = time.monotonic() - started
    expect_error(result, "did not finish within 1 s", "process group were killed")
    assert 1 <= elapsed < 1 + GRACE_S + 1.5
    dcgmi, child = fake.pids()
    assert wait_gone([dcgmi, child]), "dcgmi or its child still runs"


def test_a_process_ignoring_sigterm_is_killed_after_the_grace(fake: FakeDcgmi) -> None:
    fake.mode("hang-ignoring-term")
    done = run_process(["dcgmi", "diag", "-r", "1", "-j"], timeout_s=0.3, term_grace_s=GRACE_S)
    assert done.timed_out
    assert done.returncode == -9  # SIGKILL: TERM was ignored
    assert 0.3 + GRACE_S <= done.duration_s < 2
    assert wait_gone(fake.pids())


def test_a_child_escaping_the_group_cannot_hold_the_run(
    fake: FakeDcgmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "_DRAIN_S", 0.2)
    fake.mode("hang-with-escaped-child")
    try:
        done = run_process(["dcgmi", "diag", "-r", "1", "-j"], timeout_s=0.3, term_grace_s=GRACE_S)
    finally:
        dcgmi, escaped = fake.pids()
        os.kill(escaped, signal.SIGKILL)  # ours to clean up: it left the process group on purpose
    assert done.timed_out and done.returncode == -signal.SIGTERM
    assert done.duration_s < 2
    assert wait_gone([dcgmi])


def test_invalid_level_and_node_never_reach_dcgmi(fake: FakeDcgmi, diagnostics: DcgmDiagnostics) -> None:
    fake.mode("fixture", "l1_pass.json")
    expect_error(diagnostics.run(NODE, 5, 30), "level 5 does not exist")
    expect_error(diagnostics.run("gpu[01-04]", 1, 30), "is not a node name")
    expect_error(diagnostics.run("-oProxyCommand=x", 1, 30), "is not a node name")
    assert not fake.args_file.exists()


def test_local_runner_refuses_another_node(fake: FakeDcgmi) -> None:
    fake.mode("fixture", "l1_pass.json")
    result = DcgmDiagnostics(LocalRunner()).run("some-other-node", 1, 30)
    expect_error(result, "runs on", "not on some-other-node", "MEDIC_DCGM_RUNNER=srun or ssh")
    assert not fake.args_file.exists()


def test_local_runner_accepts_this_host() -> None:
    done = LocalRunner().run("localhost", ["sh", "-c", "echo out; echo err >&2; exit 3"], 10)
    assert (done.stdout, done.stderr, done.returncode, done.timed_out) == ("out\n", "err\n", 3, False)


# --- srun and ssh: the commands they build ------------------------------------------------


def test_srun_command() -> None:
    runner = SrunRunner(extra_args=["--reservation=medic", "--partition=maint"])
    assert runner.command(NODE, ["dcgmi", "diag", "-r", "3", "-j"]) == [
        "srun",
        "-w",
        NODE,
        "--ntasks=1",
        "--immediate=30",
        "--quiet",
        "--reservation=medic",
        "--partition=maint",
        "dcgmi",
        "diag",
        "-r",
        "3",
        "-j",
    ]


def test_srun_runs_through_srun_with_slurm_conf(fake: FakeDcgmi, tmp_path: Path) -> None:
    # A stand-in srun: records what it was given, drops its options and runs the command.
    install(
        fake.bin,
        "srun",
        '#!/bin/sh\necho "$SLURM_CONF $*" > "$FAKE_SRUN_SEEN"\n'
        'while [ $# -gt 0 ]; do case "$1" in -w) shift 2 ;; -*) shift ;; *) break ;; esac; done\n'
        'exec "$@"\n',
    )
    seen = tmp_path / "srun-seen"
    fake.monkeypatch.setenv("FAKE_SRUN_SEEN", str(seen))
    fake.mode("fixture", "l2_memory_faulty.json", rc=205)
    backend = DcgmDiagnostics(
        runner_from_env({"MEDIC_DCGM_RUNNER": "srun", "SLURM_CONF": "/etc/slurm/test.conf"})
    )
    result = backend.run(NODE, 2, 30)
    assert seen.read_text().split() == [
        "/etc/slurm/test.conf",
        "-w",
        NODE,
        "--ntasks=1",
        "--immediate=30",
        "--quiet",
        "dcgmi",
        "diag",
        "-r",
        "2",
        "-j",
    ]
    assert (result.result, result.error_ids) == ("fail", ("DCGM_FR_FAULTY_MEMORY",))


def test_srun_failure_names_the_command(fake: FakeDcgmi) -> None:
    install(
        fake.bin,
        "srun",
        "#!/bin/sh\necho 'srun: error: Unable to allocate resources: Invalid node name specified' >&2\nexit 1\n",
    )
    result = DcgmDiagnostics(SrunRunner()).run(NODE, 1, 30)
    expect_error(
        result,
        f"`srun -w {NODE} --ntasks=1 --immediate=30 --quiet dcgmi diag -r 1 -j` exited 1",
        "Invalid node name",
    )


def test_ssh_command_quotes_the_remote_words_and_bounds_them_remotely() -> None:
    runner = SshRunner(extra_args=["-i", "/etc/medic/id_ed25519"], term_grace_s=5)
    assert runner.command(NODE, ["/opt/dcgm dir/dcgmi", "diag", "-r", "1", "-j"], timeout_s=120) == [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=10",
        "-i",
        "/etc/medic/id_ed25519",
        "--",
        NODE,
        "timeout --kill-after=5 125 '/opt/dcgm dir/dcgmi' diag -r 1 -j",
    ]


def test_ssh_runs_the_remote_command_through_a_shell(fake: FakeDcgmi) -> None:
    # A stand-in ssh: drops its options and the node, then runs the command string as sshd would.
    install(
        fake.bin,
        "ssh",
        '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift 2\nexec sh -c "$*"\n',
    )
    fake.mode("fixture", "l3_thermal.json", rc=226)
    result = DcgmDiagnostics(SshRunner(term_grace_s=GRACE_S)).run(NODE, 3, 30)
    assert fake.args_file.read_text().split() == ["diag", "-r", "3", "-j"]
    assert (result.result, result.error_ids) == ("fail", ("DCGM_FR_TEMP_VIOLATION",))


def test_runner_choice_from_the_environment() -> None:
    assert isinstance(runner_from_env({"MEDIC_DCGM_RUNNER": "local"}), LocalRunner)
    assert isinstance(runner_from_env({"MEDIC_DCGM_RUNNER": "ssh"}), SshRunner)
    srun = runner_from_env(
        {"MEDIC_DCGM_RUNNER": "srun", "MEDIC_DCGM_RUNNER_ARGS": "--reservation='medic maint'"}
    )
    assert isinstance(srun, SrunRunner) and srun.extra_args == ("--reservation=medic maint",)
    assert isinstance(runner_from_env({}), SshRunner)
    with pytest.raises(RunnerConfigError, match="choose one of local, srun, ssh"):
        runner_from_env({"MEDIC_DCGM_RUNNER": "pdsh"})
    with pytest.raises(RunnerConfigError, match="not local"):
        runner_from_env({"MEDIC_DCGM_RUNNER": "local", "MEDIC_DCGM_RUNNER_ARGS": "-x"})


def test_from_env_takes_dcgmis_path() -> None:
    backend = DcgmDiagnostics.from_env(
        {"MEDIC_DCGM_RUNNER": "ssh", "MEDIC_DCGMI": "/usr/local/dcgm/bin/dcgmi"}
    )
    assert isinstance(backend.runner, SshRunner)
    assert backend.command(2) == ["/usr/local/dcgm/bin/dcgmi", "diag", "-r", "2", "-j"]
