"""`medic demo` end to end: the real flows on Prefect, a simulated fleet, a SQLite store."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.store import Store

pytestmark = pytest.mark.usefixtures("prefect_harness")


def test_demo_remediates_hardware_and_leaves_application_faults_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("MEDIC_BACKENDS")  # the demo chooses the simulation itself: no setting needed
    result = CliRunner().invoke(app, ["demo"])
    assert result.exit_code == 0, result.output

    store = Store(f"sqlite:///{tmp_path / 'demo.db'}")
    incidents = {i.node: i for i in store.find_incidents()}
    assert {n: (i.classification, i.action, i.status) for n, i in incidents.items()} == {
        "gpu-node-3": ("hardware", "reboot", "closed"),
        "gpu-node-5": ("software", "none", "closed"),
        "gpu-node-2": ("hardware", "replace", "closed"),
        "gpu-node-7": ("unknown", "diagnose", "escalated"),  # observed only: told, its fault people's
        "leaf-3": ("infrastructure", "escalate", "escalated"),
        # The nightly sweep: the idle node whose GPU 6 is wearing out, found before a job met it.
        "gpu-node-12": ("hardware", "replace", "closed"),
    }
    assert "gpu-node-12: held by reservation medic-sweep-sim-gpu-node-12, DCGM level 2 fail" in result.output
    swept = store.incident_detail(incidents["gpu-node-12"].id)
    assert swept is not None and [e.source for e in swept.events] == ["medic-sweep"]
    # The malformed lines were kept, not lost, and did not stop the rest.
    assert len(store.rejections()) == 2
    # The application fault touched nothing on its node.
    software = store.incident_detail(incidents["gpu-node-5"].id)
    assert software is not None and software.actions == []
    # The XID 79 storm was one incident whose job resumed from its checkpoint.
    reboot = store.incident_detail(incidents["gpu-node-3"].id)
    assert reboot is not None and len(reboot.events) == 6
    resume = next(s for s in reboot.steps if s.stage == "resume job")
    assert resume.detail is not None and resume.detail["checkpoint_step"] == 12_000
    assert "resumed from step 12000" in result.output
    assert "L2 fail (DCGM_FR_FAULTY_MEMORY)" in result.output
    # The straggler's profile blamed the device, so the ladder started at level 2 (docs/culprit.md):
    # its memory test failed, the node was replaced, and level 1 let the new one in.
    climbed = store.incident_detail(incidents["gpu-node-2"].id)
    assert climbed is not None
    assert [(d.level, d.result) for d in climbed.diagnostics] == [(2, "fail"), (1, "pass")]
    # Its straggler came from comparing the job's four ranks with one another, not from a rank's say-so.
    peers = [e for e in climbed.events if e.kind == "straggler"]
    assert peers and {(e.rank, e.attributes["detector"]) for e in peers} == {(1, "peer")}
    assert not any(i.node in ("gpu-node-1", "gpu-node-4") for i in incidents.values())  # its peers
    # GPU Medic asked rank 1 and a healthy peer for a profile of the same steps; the job answered with
    # its traces (recorded real ones), and the stragglers named after the diff carry its verdict.
    artifacts = tmp_path / "artifacts" / "demo" / "llm-pretrain"
    assert sorted(p.name for p in artifacts.iterdir()) == [
        "llm-pretrain-r0-step12339-profile.pt.trace.json",
        "llm-pretrain-r1-step12339-profile.pt.trace.json",
    ]
    judged = [e.attributes for e in peers if "straggler_cause" in e.attributes]
    assert judged and {a["straggler_cause"] for a in judged} == {"hardware-compute"}
    assert {a["straggler_cause_peer_artifact"] for a in judged} == {
        str(artifacts / "llm-pretrain-r0-step12339-profile.pt.trace.json")
    }
    assert [d.rule for d in climbed.decisions] == ["straggler-hardware-cause", "diag-isolate"]
    assert "Why it is slow: hardware-compute" in result.output
    assert "profile of a healthy peer, against rank 1 on gpu-node-2" in result.output
    # The event file holds what the feed held, the job's reports too: `medic triage` reads it again.
    feed = (tmp_path / "demo-events.jsonl").read_text().splitlines()
    assert sum('"check": "step_timings"' in line or '"check":"step_timings"' in line for line in feed) == 16
    stages = [s.stage for s in climbed.steps if s.stage not in ("notify", "update")]  # the chat's own pace
    climb = ["triage", "diagnose L2", "decide", "approval", "act: replace"]
    assert [s for s in stages if s in climb] == climb, stages
    # Replacing wipes the node: the policy asks first, and the demo answers as a person would.
    (approval,) = store.approvals(climbed.incident.id)
    assert (approval.action, approval.approved, approval.by, approval.via) == (
        "replace",
        True,
        "demo",
        "demo",
    )
    assert "approved by demo: Approval needed: replace gpu-node-2" in result.output
    assert "↳ approved by demo via demo" in result.output
    # The lone NCCL timeout is on a node of the demo's observed group: decided, said, not touched.
    lone = store.incident_detail(incidents["gpu-node-7"].id)
    assert lone is not None and lone.diagnostics == [] and lone.actions == []
    assert {(d.mode, d.node_group) for d in lone.decisions} == {("observe", "canary")}
    assert "Would have: diagnose L1 gpu-node-7 (rule lone-nccl-timeout)" in result.output
    assert {(d.mode, d.node_group) for d in reboot.decisions} == {("remediate", None)}  # beside it, acted on
    assert "Slack → #gpu-ops" in result.output
    # The switch storm was one incident about the switch, told to the network team, no node touched.
    storm = store.incident_detail(incidents["leaf-3"].id)
    assert storm is not None and storm.incident.scope == "switch" and len(storm.events) == 12
    assert storm.actions == [] and storm.diagnostics == []
    assert "Slack → #network-oncall" in result.output
    assert "Infrastructure fault on switch leaf-3 (4 nodes): escalate" in result.output
