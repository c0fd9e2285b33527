"""DcgmDiagnostics and the runners against a fake `dcgmi` executable (tests/fixtures/dcgm/fake_dcgmi.sh).

The fake stands in for NVIDIA's binary only: the process handling, the timeout kill and the
parsing under test are the real ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from checkout import REPO_ROOT, TEST_FIXTURES
from factories import fault_event, incident

from medic.dcgm_errors import Severity
from medic.facts import facts_of
from medic.integrations import registry
from medic.integrations.dcgm import runner
from medic.integrations.dcgm.diagnostics import DcgmDiagnostics
from medic.integrations.dcgm.runner import (
    LocalRunner,
    RunnerConfigError,
    SrunRunner,
    SshRunner,
    run_process,
    runner_from_env,
)
from medic.integrations.sim.fleet import SimFleet
from medic.policy import Action
from medic.protocols import DiagnosticResult, Diagnostics, NodeState
from medic.store import Store
from medic.tasks.runtime import process as runtime_module
from medic.tasks.runtime.process import Runtime, configure
from medic.tasks.verify import verify

FIXTURES = TEST_FIXTURES / "dcgm"
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


@pytest.mark.parametrize(
    ("fixture", "fragments"),
    [
        (
            "l2_skipped.json",
            (
                f"DCGM level 2 on {NODE}: incomplete, not every test of the level ran: memory skipped",
                "pcie skipped (The pcie test is skipped.)",
            ),
        ),
        (
            "v3/l2_skipped_3.3.json",
            ("incomplete", "PCIe skipped (no reason given in the output)", "GPU Memory"),
        ),
    ],
)
def test_skipped_tests_of_the_level_are_no_pass(
    fake: FakeDcgmi, diagnostics: DcgmDiagnostics, fixture: str, fragments: tuple[str, ...]
) -> None:
    # dcgmi exits 0 here: every result is Pass or Skip. Still never a pass: "error", escalated.
    fake.mode("fixture", fixture)
    expect_error(diagnostics.run(NODE, 2, 30), *fragments)


def test_one_gpu_skipped_is_no_pass(fake: FakeDcgmi, diagnostics: DcgmDiagnostics, tmp_path: Path) -> None:
    data = json.loads((FIXTURES / "l2_pass.json").read_text())
    memory = data["DCGM Diagnostic"]["test_categories"][1]["tests"][0]
    memory["results"][5]["status"] = "Skip"
    (tmp_path / "one_skip.json").write_text(json.dumps(data))
    fake.monkeypatch.setenv("FAKE_DCGMI_MODE", "fixture")
    fake.monkeypatch.setenv("FAKE_DCGMI_FIXTURE", str(tmp_path / "one_skip.json"))
    expect_error(diagnostics.run(NODE, 2, 30), "incomplete", "memory skipped on GPU 5")


def test_a_required_test_missing_from_the_level_is_no_pass(
    fake: FakeDcgmi, diagnostics: DcgmDiagnostics, tmp_path: Path
) -> None:
    data = json.loads((FIXTURES / "l3_thermal.json").read_text())
    for category in data["DCGM Diagnostic"]["test_categories"]:
        category["tests"] = [t for t in category["tests"] if t["name"] != "targeted_power"]
    (tmp_path / "no_tp.json").write_text(json.dumps(data))
    fake.monkeypatch.setenv("FAKE_DCGMI_MODE", "fixture")
    fake.monkeypatch.setenv("FAKE_DCGMI_FIXTURE", str(tmp_path / "no_tp.json"))
    expect_error(diagnostics.run(NODE, 3, 30), "incomplete", "targeted_power missing")


def test_dcgm_3_pass(fake: FakeDcgmi, diagnostics: DcgmDiagnostics) -> None:
    fake.mode("fixture", "v3/l2_pass_3.3.json")
    result = diagnostics.run(NODE, 2, timeout_s=30)
    assert (result.result, result.error_ids) == ("pass", ())
    assert result.detail.startswith(f"DCGM level 2 pass on {NODE}: 11 tests on 2 GPUs (Denylist, ")


@pytest.mark.parametrize(
    ("fixture", "level", "error_ids", "in_detail"),
    [
        (
            "v3/l3_thermal_3.3.json",
            3,
            ("DCGM_FR_TEMP_VIOLATION",),
            "GPU 0 Targeted Power DCGM_FR_TEMP_VIOLATION (MONITOR): Temperature 93 of GPU 0",
        ),
        (
            "v3/l2_memory_faulty_3.2.json",
            2,
            ("DCGM_FR_FAULTY_MEMORY",),
            "GPU 1 GPU Memory DCGM_FR_FAULTY_MEMORY (ISOLATE)",
        ),
    ],
)
def test_dcgm_3_failures(
    fake: FakeDcgmi,
    diagnostics: DcgmDiagnostics,
    fixture: str,
    level: int,
    error_ids: tuple[str, ...],
    in_detail: str,
) -> None:
    fake.mode("fixture", fixture, rc=205)
    result = diagnostics.run(NODE, level, timeout_s=30)
    assert (result.result, result.error_ids) == ("fail", error_ids)
    assert in_detail in result.detail


def test_dcgm_3_runtime_error(fake: FakeDcgmi, diagnostics: DcgmDiagnostics) -> None:
    fake.mode("fixture", "v3/runtime_error_3.3.json", rc=1)
    expect_error(diagnostics.run(NODE, 1, 30), "DCGM reported a runtime error", "while DCGM is paused")


def test_an_unknown_id_shows_the_severity_the_output_states(
    fake: FakeDcgmi, diagnostics: DcgmDiagnostics, tmp_path: Path
) -> None:
    data = json.loads((FIXTURES / "l2_memory_faulty.json").read_text())
    memory = data["DCGM Diagnostic"]["test_categories"][1]["tests"][0]
    for warning in [*memory["results"][3]["warnings"], *memory["test_summary"]["warnings"]]:
        warning.update(error_id=141, error_severity=6, error_category=10)
    (tmp_path / "newer.json").write_text(json.dumps(data))
    fake.monkeypatch.setenv("FAKE_DCGMI_MODE", "fixture")
    fake.monkeypatch.setenv("FAKE_DCGMI_FIXTURE", str(tmp_path / "newer.json"))
    result = diagnostics.run(NODE, 2, 30)
    assert (result.result, result.error_ids) == ("fail", ("141",))
    assert "GPU 3 memory 141 (RESET)" in result.detail


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


@pytest.mark.parametrize(("fixture", "passed"), [("l2_skipped.json", False), ("l2_pass.json", True)])
def test_verification_never_reintegrates_on_an_incomplete_run(
    fake: FakeDcgmi, sqlite_store: Store, fleet: SimFleet, fixture: str, passed: bool
) -> None:
    node = sorted(fleet.nodes)[0]
    backends = dataclasses.replace(
        registry.simulated(fleet)[0], diagnostics=DcgmDiagnostics(LocalRunner(aliases=[node]))
    )
    fake.monkeypatch.setattr(runtime_module, "_current", None)  # put back after the test
    configure(Runtime(sqlite_store, backends, REPO_ROOT / "policies" / "default.yaml"))
    inc = incident(fault_event(node=node), node=node)
    sqlite_store.open_incident(inc)
    backends.scheduler.drain(node, "medic: DCGM level 2")
    fake.mode("fixture", fixture)
    outcome = verify.fn(inc.id, node, 2, Action.REBOOT, ready_timeout_s=1)
    assert outcome.passed is passed, outcome.detail
    state = backends.scheduler.node(node).state
    assert state is (NodeState.IDLE if passed else NodeState.DRAINED)
    if not passed:
        assert outcome.detail == "DCGM level 2 error after repair; kept out of service"


def test_an_id_newer_than_our_table_reaches_the_policy_with_the_severity_dcgm_stated(
    fake: FakeDcgmi, diagnostics: DcgmDiagnostics, tmp_path: Path
) -> None:
    data = json.loads((FIXTURES / "l2_memory_faulty.json").read_text())
    for category in data["DCGM Diagnostic"]["test_categories"]:
        for test in category["tests"]:
            for result in [test.get("test_summary", {}), *test.get("results", [])]:
                for warning in result.get("warnings", []):
                    # An id a later DCGM adds, stated ISOLATE (2) by the output itself.
                    warning.update(error_id=999, error_severity=2)
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(data))
    fake.mode("fixture", str(newer), rc=226)
    result = diagnostics.run(NODE, 2, timeout_s=30)
    assert (result.result, result.error_ids, result.worst_severity) == ("fail", ("999",), "ISOLATE")

    ran = fault_event(
        "diagnostic",
        node=NODE,
        attributes={"level": 2, "result": "fail", "error_ids": ["999"], "worst_severity": "ISOLATE"},
    )
    [seen] = facts_of(incident(fault_event("xid", node=NODE), ran)).diagnostics
    assert (seen.error_names, seen.worst_severity) == (("999",), Severity.ISOLATE)
