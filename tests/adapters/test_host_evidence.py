"""Host evidence kept before a reboot or replacement: the real capture over the local runner with
recorded `nvidia-smi -q` output and driver-format kernel log lines, and the act path on real Prefect
(test harness): the files are written before the action, a failing or slow capture does not stop it,
and a retried action does not read the node again."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import shutil
import stat
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from checkout import REPO_ROOT, TEST_FIXTURES
from factories import fault_event

from medic.audit import incident_markdown
from medic.flows.dispatch import Dispatch, remediate_all
from medic.intake import read_lines
from medic.integrations.dcgm.runner import LocalRunner
from medic.integrations.host_evidence import KERNEL_LOG_BYTES, NodeHostEvidence, gpu_lines
from medic.integrations.registry import Backends
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.sim.notifier import RecordingNotifier
from medic.integrations.sim.provider import SimProvider
from medic.policy import Action
from medic.statuses import StepStatus
from medic.store import Store
from medic.tasks.nodes import host_evidence
from medic.tasks.runtime.process import Runtime, configure

FIXTURES = TEST_FIXTURES
KERNEL_LOG = (FIXTURES / "xid" / "kernel_log.txt").read_text()
NVIDIA_SMI_Q = (FIXTURES / "nvml" / "h100-sxm-x8-565.57.01.txt").read_text()
DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"
NODE = "gpu-node-1"
# Lines a kernel log holds besides the drivers' (not ours to keep).
OTHER_LINES = [
    "[    5.100] EXT4-fs (nvme0n1p2): mounted filesystem with ordered data mode. Quota mode: none.",
    "[  812.300] IPv6: ADDRCONF(NETDEV_CHANGE): ib0: link becomes ready",
]
T0 = datetime.now(UTC) - timedelta(minutes=5)


def program(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def node_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node's programs, ahead of this machine's on PATH: `dmesg` prints the recorded XID lines among
    others, `nvidia-smi -q` a recorded H100 node; no nvidia-bug-report.sh unless a test writes one."""
    folder = tmp_path / "bin"
    folder.mkdir()
    log = tmp_path / "dmesg.txt"
    log.write_text("\n".join([OTHER_LINES[0], *KERNEL_LOG.splitlines(), OTHER_LINES[1]]) + "\n")
    smi = tmp_path / "smi.txt"
    smi.write_text(NVIDIA_SMI_Q)
    program(folder, "dmesg", f"cat '{log}'")
    program(folder, "nvidia-smi", f"[ \"$1\" = -q ] && exec cat '{smi}'\nexit 2")
    # Only our programs and the few the capture's shell needs: a bug report script on this machine
    # must not count as the node's.
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("sh", "cat", "base64", "gzip", "mktemp", "rm", "sleep"):
        found = shutil.which(tool)
        assert found is not None, tool
        (tools / tool).symlink_to(found)
    monkeypatch.setenv("PATH", f"{folder}:{tools}")
    return folder


def local_capture() -> NodeHostEvidence:
    return NodeHostEvidence(LocalRunner(aliases=[NODE], term_grace_s=0.5))


# --- the real capture ---------------------------------------------------------------------------


def test_kernel_log_keeps_the_drivers_lines_only() -> None:
    kept = gpu_lines("\n".join([OTHER_LINES[0], *KERNEL_LOG.splitlines(), OTHER_LINES[1]]))
    assert kept == KERNEL_LOG  # every XID and SXid line, in order; nothing else


def test_kernel_log_excerpt_is_bounded_and_keeps_the_newest() -> None:
    flood = [
        f"[ {i}.000] NVRM: Xid (PCI:0000:3b:00): 13, pid=4412, name=python3, Graphics SM Warp Exception"
        for i in range(5000)
    ]
    kept = gpu_lines("\n".join(flood)).splitlines()
    assert kept[-1] == flood[-1] and len(kept) <= 2000
    assert len(gpu_lines("\n".join(flood), max_lines=10_000).encode()) <= KERNEL_LOG_BYTES


def test_capture_reads_kernel_log_and_nvidia_smi_and_says_no_bug_report(node_bin: Path) -> None:
    capture = local_capture().capture(NODE, timeout_s=20)
    files = {f.name: f.content.decode() for f in capture.files}
    assert files == {"kernel-log.txt": KERNEL_LOG, "nvidia-smi-q.txt": NVIDIA_SMI_Q}
    assert "NVIDIA H100 80GB HBM3" in files["nvidia-smi-q.txt"]
    assert capture.missing == (f"nvidia-bug-report.sh: not installed on {NODE}",)


def test_capture_brings_back_the_bug_report_where_present(node_bin: Path) -> None:
    program(
        node_bin,
        "nvidia-bug-report.sh",
        # What the script does: --output-file F writes F.gz where gzip is found.
        '[ "$1" = --safe-mode ] && [ "$2" = --output-file ] || exit 2\necho report | gzip > "$3.gz"',
    )
    capture = local_capture().capture(NODE, timeout_s=20)
    report = next(f for f in capture.files if f.name == "nvidia-bug-report.log.gz")
    assert gzip.decompress(report.content) == b"report\n"
    assert capture.missing == ()


def test_a_hung_part_costs_only_its_time(node_bin: Path) -> None:
    program(node_bin, "nvidia-smi", "exec sleep 60")  # the driver does not answer
    started = time.monotonic()
    capture = local_capture().capture(NODE, timeout_s=2)
    assert time.monotonic() - started < 10
    assert [f.name for f in capture.files] == ["kernel-log.txt"]
    assert "nvidia-smi -q: did not finish within" in capture.missing[0]
    # Nothing was left for the bug report: said so, not started.
    assert capture.missing[1].startswith("nvidia-bug-report.sh: not started")


def test_a_node_the_runner_cannot_reach_is_said(node_bin: Path) -> None:
    capture = local_capture().capture("gpu-node-9", timeout_s=5)
    assert capture.files == ()
    assert all("could not start" in m or "not started" in m for m in capture.missing)


# --- the act path --------------------------------------------------------------------------------


class WitnessedProvider(SimProvider):
    """The simulated provider, noting which evidence files were on disk when it was asked to reboot."""

    def __init__(self, fleet: SimFleet, root: Path) -> None:
        super().__init__(fleet)
        self.root = root
        self.seen: list[list[str]] = []

    def reboot(self, node: str) -> str:
        self.seen.append(sorted(p.name for p in self.root.rglob("*") if p.is_file()))
        return super().reboot(node)


@pytest.fixture
def rt(sqlite_store: Store, fleet: SimFleet, sim_backends: Backends, tmp_path: Path) -> Runtime:
    root = tmp_path / "artifacts"
    backends = dataclasses.replace(sim_backends, provider=WitnessedProvider(fleet, root))
    fleet.add_job("llm", "alice", [NODE, "gpu-node-2"], step=1_234, checkpoint_every=100)
    fleet.crash_job("llm")
    return configure(Runtime(sqlite_store, backends, DEFAULT_POLICY, root))


def xid79() -> list[str]:
    return [
        fault_event(
            "xid", id=f"ev-{i}", node=NODE, at=T0, seconds=i * 0.1, gpu=3, job="llm", attributes={"code": 79}
        ).model_dump_json()
        for i in range(3)
    ]


def remediate(rt: Runtime) -> Dispatch:
    return asyncio.run(remediate_all(rt, read_lines(xid79(), "test.jsonl")))


def calls(fleet: SimFleet) -> list[str]:
    return [action for node, action in fleet.calls if node == NODE]


def evidence_steps(rt: Runtime, incident_id: str) -> list[tuple[str, str, dict[str, Any]]]:
    detail = rt.store.incident_detail(incident_id)
    assert detail is not None
    return [(s.status, s.summary, s.detail or {}) for s in detail.steps if s.stage == host_evidence.STAGE]


@pytest.mark.usefixtures("prefect_harness")
def test_evidence_is_kept_before_the_reboot_and_listed(rt: Runtime, fleet: SimFleet) -> None:
    (outcome,) = remediate(rt).outcomes
    assert (outcome.action, outcome.act) == ("reboot", "done")
    assert calls(fleet)[:3] == ["drain", "host_evidence", "reboot"]
    provider = rt.backends.provider
    assert isinstance(provider, WitnessedProvider)
    assert provider.seen == [["events.jsonl", "kernel-log.txt", "nvidia-smi-q.txt"]]

    assert rt.artifact_root is not None
    folder = host_evidence.evidence_dir(rt.artifact_root, outcome.incident, NODE, Action.REBOOT)
    assert (folder / "kernel-log.txt").read_text() == "simulated kernel log\n"  # a healthy node: no XID
    events = (folder / "events.jsonl").read_text().splitlines()
    assert len(events) == 3 and all('"node":"gpu-node-1"' in e for e in events)

    ((status, summary, detail),) = evidence_steps(rt, outcome.incident)
    assert status == StepStatus.OK and "nvidia-bug-report.sh: not installed" in summary
    paths = [a["path"] for a in detail["artifacts"]]
    assert sorted(Path(p).name for p in paths) == ["events.jsonl", "kernel-log.txt", "nvidia-smi-q.txt"]
    # The message (queued after the act on this path) and the audit artifact list every file.
    notifier = rt.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    (thread,) = notifier.threads.values()
    assert [a.path for a in thread.message.artifacts] == paths
    assert "host evidence kept (3 files)" in thread.replies[0]
    detail_all = rt.store.incident_detail(outcome.incident)
    assert detail_all is not None
    markdown = incident_markdown(detail_all)
    assert "## Evidence files" in markdown and all(f"`{p}`" in markdown for p in paths)


@pytest.mark.usefixtures("prefect_harness")
def test_a_failing_capture_does_not_stop_the_reboot(rt: Runtime, fleet: SimFleet) -> None:
    fleet.fail_next(NODE, "host_evidence", times=5, permanent=True)
    (outcome,) = remediate(rt).outcomes
    assert (outcome.action, outcome.act) == ("reboot", "done")
    assert "reboot" in calls(fleet)
    ((status, summary, _),) = evidence_steps(rt, outcome.incident)
    assert status == StepStatus.FAILED
    assert summary.startswith("none kept (SimPermanentFailure") and summary.endswith("reboot goes ahead")


@pytest.mark.usefixtures("prefect_harness")
def test_a_slow_capture_is_cut_off_and_the_reboot_goes_ahead(
    rt: Runtime, fleet: SimFleet, node_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("dmesg", "nvidia-smi"):
        program(node_bin, name, "exec sleep 60")  # a wedged driver
    monkeypatch.setattr(host_evidence, "CAPTURE_TIMEOUT_S", 2.0)
    rt = configure(
        Runtime(
            rt.store,
            dataclasses.replace(rt.backends, host_evidence=local_capture()),
            rt.policy_path,
            rt.artifact_root,
        )
    )
    started = time.monotonic()
    (outcome,) = remediate(rt).outcomes
    assert (outcome.action, outcome.act) == ("reboot", "done")
    assert "reboot" in calls(fleet)
    ((status, summary, detail),) = evidence_steps(rt, outcome.incident)
    assert status == StepStatus.FAILED and "did not finish within" in summary
    # What the store knows is kept all the same.
    assert [Path(a["path"]).name for a in detail["artifacts"]] == ["events.jsonl"]
    assert time.monotonic() - started < 60


@pytest.mark.usefixtures("prefect_harness")
def test_a_retried_reboot_does_not_read_the_node_again(rt: Runtime, fleet: SimFleet) -> None:
    fleet.fail_next(NODE, "reboot", times=1)  # transient: `act` tries again
    (outcome,) = remediate(rt).outcomes
    assert outcome.act == "done"
    assert calls(fleet).count("reboot") == 2
    assert calls(fleet).count("host_evidence") == 1
    assert [s for s, _, _ in evidence_steps(rt, outcome.incident)] == [StepStatus.OK]


@pytest.mark.usefixtures("prefect_harness")
def test_without_an_artifact_root_nothing_is_read(rt: Runtime, fleet: SimFleet) -> None:
    rt = configure(Runtime(rt.store, rt.backends, rt.policy_path))
    (outcome,) = remediate(rt).outcomes
    assert outcome.act == "done"
    assert "host_evidence" not in calls(fleet)
    assert evidence_steps(rt, outcome.incident) == []
