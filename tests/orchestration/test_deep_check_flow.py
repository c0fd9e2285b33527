"""The deep health check suite run for real on Prefect (test harness) over the simulated fleet: the
`deep-check` flow and `medic check deep`, the evidence kept on the incident, and the rule that a
replaced or repaired node returns to service only once the checks its policy requires pass."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from factories import fault_event, incident
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.deep_check import Verdict
from medic.flows.deep_check import deep_check
from medic.flows.dispatch import Dispatch, remediate_all
from medic.intake import read_lines
from medic.integrations import registry
from medic.integrations.registry import Backends
from medic.integrations.sim.fleet import SimFleet
from medic.policy.deep_checks import CheckName
from medic.protocols import NodeState
from medic.store import Store, utcnow
from medic.tasks.nodes.service import reintegrate_node
from medic.tasks.runtime.process import Runtime, configure

pytestmark = pytest.mark.usefixtures("prefect_harness")

POLICY = """\
version: 1
approvals: {required_for: []}
deep_checks:
  dcgm_level: 3
  shapes:
    h100-8:
      gpus: 8
      nvlinks_per_gpu: 18
      busbw_floor_gbps: 400
      multi_node_busbw_floor_gbps: 300
      rdma_devices: [mlx5_0, mlx5_1]
      nic_bw_floor_gbps: 350
  nodes:
    "gpu-node-*": h100-8
  require:
    after_replace: [gpu_count, nvlink, dcgm, all_reduce]
    after_repair: [gpu_count, nvlink]
rules:
  - id: fallen-off-bus
    description: XID 79, the GPU has fallen off the bus
    when: {xid: [79]}
    then: {classification: hardware, action: replace}
  - id: diag-pass-reintegrate
    description: The node we took out of service passed its diagnostic
    when:
      diagnostic: {result: pass}
      out_of_service: true
    then: {classification: hardware, action: reintegrate}
"""


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    path = tmp_path / "deep.yaml"
    path.write_text(POLICY)
    return path


@pytest.fixture
def rt(sqlite_store: Store, sim_backends: Backends, policy: Path) -> Runtime:
    return configure(Runtime(sqlite_store, sim_backends, policy))


def drained(fleet: SimFleet, *nodes: str) -> None:
    for node in nodes:
        fleet.nodes[node].state = NodeState.DRAINED
        fleet.nodes[node].reason = "medic: deep check"


def opened(rt: Runtime, node: str) -> str:
    inc = incident(fault_event(node=node), node=node)
    rt.store.open_incident(inc)
    return inc.id


def calls(fleet: SimFleet, node: str) -> list[str]:
    return [action for target, action in fleet.calls if target == node]


def test_every_check_passes_and_each_output_is_kept_on_the_incident(rt: Runtime, fleet: SimFleet) -> None:
    drained(fleet, "gpu-node-1", "gpu-node-2")
    inc = opened(rt, "gpu-node-1")
    report = asyncio.run(deep_check(["gpu-node-1", "gpu-node-2"], inc))
    assert report.verdict is Verdict.PASS
    assert [(r.check.value, r.nodes, r.verdict.value) for r in report.results] == [
        ("gpu_count", ["gpu-node-1"], "pass"),
        ("nvlink", ["gpu-node-1"], "pass"),
        ("dcgm", ["gpu-node-1"], "pass"),
        ("nic_loopback", ["gpu-node-1"], "pass"),
        ("gpu_count", ["gpu-node-2"], "pass"),
        ("nvlink", ["gpu-node-2"], "pass"),
        ("dcgm", ["gpu-node-2"], "pass"),
        ("nic_loopback", ["gpu-node-2"], "pass"),
        ("all_reduce", ["gpu-node-1", "gpu-node-2"], "pass"),
    ]
    assert report.results[3].reason == (
        "mlx5_0 390 Gb/s, mlx5_1 390 Gb/s; floor 350 Gb/s; "
        "mlx5_0 1.5 µs, mlx5_1 1.5 µs typical latency; no ceiling in shape h100-8"
    )
    reduce = report.results[-1]
    assert (
        reduce.reason == "busbw 360 GB/s at 8 GiB on 16 ranks, floor 300 GB/s"
    )  # across nodes: the network's floor
    assert calls(fleet, "gpu-node-1") == [
        "nvml",
        "diagnose-l3",
        "nic_loopback",
        "nic_loopback",
        "nic_latency",
        "nic_latency",
        "all_reduce",
    ]

    detail = rt.store.incident_detail(inc)
    assert detail is not None
    steps = {s.stage: s for s in detail.steps}
    assert sorted(steps) == [
        "deep check: all_reduce gpu-node-1, gpu-node-2",
        "deep check: dcgm gpu-node-1",
        "deep check: dcgm gpu-node-2",
        "deep check: gpu_count gpu-node-1",
        "deep check: gpu_count gpu-node-2",
        "deep check: nic_loopback gpu-node-1",
        "deep check: nic_loopback gpu-node-2",
        "deep check: nvlink gpu-node-1",
        "deep check: nvlink gpu-node-2",
    ]
    kept = steps["deep check: all_reduce gpu-node-1, gpu-node-2"]
    assert (kept.status, kept.summary) == ("ok", reduce.reason)
    assert kept.detail is not None
    assert kept.detail["output"] == reduce.output and kept.detail["output"].startswith(
        "simulated all_reduce_perf"
    )
    assert kept.detail["measured"]["busbw_gbps"] == 360
    assert json.loads(steps["deep check: nvlink gpu-node-2"].detail["output"])["gpu_count"] == 8  # type: ignore[index]
    # The nodes are checked at once: their runs are recorded in the order they ended.
    assert sorted((d.node, d.level, d.result, d.detail) for d in detail.diagnostics) == [
        ("gpu-node-1", 3, "pass", "deep check: simulated DCGM level 3: pass"),
        ("gpu-node-2", 3, "pass", "deep check: simulated DCGM level 3: pass"),
    ]


def test_a_link_down_fails_the_node_and_nothing_later_runs_on_it(rt: Runtime, fleet: SimFleet) -> None:
    drained(fleet, "gpu-node-1", "gpu-node-2")
    fleet.script_hardware("gpu-node-2", links_down=((5, 11),))
    report = asyncio.run(deep_check(["gpu-node-1", "gpu-node-2"]))
    assert report.verdict is Verdict.FAIL
    by_check = {(r.check, r.nodes[0]): r for r in report.results}
    assert by_check[(CheckName.NVLINK, "gpu-node-2")].reason == "GPU 5: 17 of 18 links up (down: 11)"
    assert by_check[(CheckName.DCGM, "gpu-node-2")].verdict is Verdict.SKIPPED
    assert report.results[-1].reason == (
        "not run: nvlink fail on gpu-node-2; dcgm skipped on gpu-node-2; nic_loopback skipped on gpu-node-2"
    )
    assert "all_reduce" not in calls(fleet, "gpu-node-1")


def test_a_nic_under_its_floor_fails_the_node_and_the_all_reduce_is_not_run(
    rt: Runtime, fleet: SimFleet
) -> None:
    drained(fleet, "gpu-node-1", "gpu-node-2")
    fleet.script_hardware("gpu-node-2", nic_gbps=180.0)
    report = asyncio.run(deep_check(["gpu-node-1", "gpu-node-2"]))
    assert report.verdict is Verdict.FAIL
    by_check = {(r.check, r.nodes[0]): r for r in report.results}
    assert by_check[(CheckName.NIC_LOOPBACK, "gpu-node-2")].reason == (
        "mlx5_0 180 Gb/s, mlx5_1 180 Gb/s, under the floor of 350 Gb/s of shape h100-8"
    )
    assert report.results[-1].reason == "not run: nic_loopback fail on gpu-node-2"
    assert "all_reduce" not in calls(fleet, "gpu-node-1")


def test_a_nic_over_its_latency_ceiling_fails_the_node(
    sqlite_store: Store, sim_backends: Backends, fleet: SimFleet, tmp_path: Path
) -> None:
    path = tmp_path / "latency.yaml"
    path.write_text(
        POLICY.replace("nic_bw_floor_gbps: 350\n", "nic_bw_floor_gbps: 350\n      nic_lat_ceiling_us: 3\n")
    )
    configure(Runtime(sqlite_store, sim_backends, path))
    drained(fleet, "gpu-node-1", "gpu-node-2")
    fleet.script_hardware("gpu-node-2", nic_lat_us=7.1)
    report = asyncio.run(deep_check(["gpu-node-1", "gpu-node-2"]))
    assert report.verdict is Verdict.FAIL
    by_check = {(r.check, r.nodes[0]): r for r in report.results}
    assert by_check[(CheckName.NIC_LOOPBACK, "gpu-node-1")].verdict is Verdict.PASS
    assert by_check[(CheckName.NIC_LOOPBACK, "gpu-node-2")].reason == (
        "mlx5_0 7.1 µs, mlx5_1 7.1 µs typical latency, over the ceiling of 3 µs of shape h100-8"
    )


def test_the_gpus_of_a_node_in_service_are_never_loaded(rt: Runtime, fleet: SimFleet) -> None:
    report = asyncio.run(deep_check(["gpu-node-4"]))
    assert report.verdict is Verdict.ERROR
    dcgm = report.results[2]
    assert (dcgm.check, dcgm.reason) == (
        CheckName.DCGM,
        "DCGM level 3 not run: gpu-node-4 is idle, in service: drain it first, the check loads every GPU",
    )
    assert calls(fleet, "gpu-node-4") == ["nvml"]


# --- the gate: back to service only after the checks the policy requires ------------------------


def replace_node(rt: Runtime, node: str, n: int = 1) -> Dispatch:
    event = fault_event("xid", id=f"ev-{node}-{n}", node=node, at=utcnow(), gpu=3, attributes={"code": 79})
    return asyncio.run(remediate_all(rt, read_lines([event.model_dump_json()], "test.jsonl")))


def test_a_replacement_under_the_bandwidth_floor_stays_out_and_escalates(
    rt: Runtime, fleet: SimFleet
) -> None:
    fleet.script_replacement("gpu-node-3", busbw_gbps=200)
    dispatch = replace_node(rt, "gpu-node-3")
    (outcome,) = dispatch.outcomes
    assert outcome.action == "replace" and outcome.verified is not None
    assert not outcome.verified.passed
    assert outcome.verified.detail == (
        "all_reduce on gpu-node-3 fail: busbw 200 GB/s at 8 GiB, under the floor of 400 GB/s of shape h100-8 "
        "after replace; gpu-node-3 drained (replaced) by GPU Medic and held for you: out of service until a "
        "human resumes it in the scheduler or a later incident reintegrates it"
    )
    assert fleet.nodes["gpu-node-3"].state is NodeState.DRAINED
    assert calls(fleet, "gpu-node-3") == ["drain", "replace", "nvml", "diagnose-l3", "all_reduce"]
    detail = rt.store.incident_detail(outcome.incident)
    assert detail is not None
    assert detail.incident.status == "escalated"
    checked = [(s.stage, s.status) for s in detail.steps if s.stage.startswith(("deep check", "verify"))]
    assert checked == [
        ("deep check: gpu_count gpu-node-3", "ok"),
        ("deep check: nvlink gpu-node-3", "ok"),
        ("deep check: dcgm gpu-node-3", "ok"),
        ("deep check: all_reduce gpu-node-3", "failed"),
        ("verify L3", "failed"),
    ]
    assert [(d.level, d.detail) for d in detail.diagnostics] == [
        (3, "verification: simulated DCGM level 3: pass")
    ]

    # A later passing diagnostic decides `reintegrate`: it re-runs no all-reduce, so it cannot return it.
    later = fault_event(
        "diagnostic", id="ev-diag", node="gpu-node-3", at=utcnow(), attributes={"level": 1, "result": "pass"}
    )
    (again,) = asyncio.run(remediate_all(rt, read_lines([later.model_dump_json()], "later.jsonl"))).outcomes
    assert again.action == "reintegrate"
    assert again.summary.endswith(
        f"gpu-node-3 not resumed: its replace in incident {outcome.incident} has not passed the deep checks "
        "the policy requires (gpu_count, nvlink, dcgm, all_reduce); a human returns it)"
    )
    assert fleet.nodes["gpu-node-3"].state is NodeState.DRAINED


def test_a_healthy_replacement_passes_every_check_and_returns(rt: Runtime, fleet: SimFleet) -> None:
    (outcome,) = replace_node(rt, "gpu-node-3").outcomes
    assert outcome.verified is not None and outcome.verified.passed
    assert (
        outcome.verified.detail
        == "DCGM level 3 passed; gpu_count, nvlink, all_reduce passed; resumed gpu-node-3"
    )
    assert fleet.nodes["gpu-node-3"].state is NodeState.IDLE
    assert calls(fleet, "gpu-node-3")[-1] == "resume"
    # Verified, the node may be returned again later.
    rt.backends.scheduler.drain("gpu-node-3", "medic: drain incident inc-later")
    assert reintegrate_node(rt, "inc-later", "gpu-node-3") == "resumed gpu-node-3"


def test_a_policy_without_deep_checks_verifies_as_before(
    sqlite_store: Store, sim_backends: Backends, fleet: SimFleet, tmp_path: Path
) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text(POLICY.split("deep_checks:")[0] + "rules:" + POLICY.split("rules:")[1])
    rt = configure(Runtime(sqlite_store, sim_backends, plain))
    (outcome,) = replace_node(rt, "gpu-node-5").outcomes
    assert outcome.verified is not None
    assert outcome.verified.detail == "DCGM level 1 passed; resumed gpu-node-5"
    assert calls(fleet, "gpu-node-5") == ["drain", "replace", "diagnose-l1", "resume"]


# --- medic check deep --------------------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sim_backends: Backends) -> Backends:
    """`medic` with its backends over the test's fleet (the simulation `from_settings` would build is
    a fresh one, whose nodes are all in service)."""
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(registry, "from_settings", lambda settings, env=None: sim_backends)
    return sim_backends


def test_medic_check_deep_json(cli: Backends, fleet: SimFleet, policy: Path) -> None:
    drained(fleet, "gpu-node-1", "gpu-node-2")
    result = CliRunner().invoke(
        app, ["check", "deep", "gpu-node-1", "gpu-node-2", "--json", "--policy", str(policy)]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    sha = out["policy"].pop("sha256")
    assert len(sha) == 64
    nvml = json.dumps(
        {
            "simulated": "NVML",
            "gpu_count": 8,
            "gpus": [{"index": i, "lost": False, "links_down": []} for i in range(8)],
        }
    )

    def node_checks(node: str) -> list[dict[str, object]]:
        return [
            {
                "check": "gpu_count",
                "nodes": [node],
                "verdict": "pass",
                "reason": "8 of 8 GPUs answer",
                "shape": "h100-8",
                "measured": {"expected": 8, "enumerated": 8, "answering": 8, "lost": []},
                "command": [],
                "output": nvml,
            },
            {
                "check": "nvlink",
                "nodes": [node],
                "verdict": "pass",
                "reason": "18 links up on each of 8 GPUs",
                "shape": "h100-8",
                "measured": {
                    "expected_per_gpu": 18,
                    "links_up": {str(i): 18 for i in range(8)},
                    "links_down": {},
                },
                "command": [],
                "output": nvml,
            },
            {
                "check": "dcgm",
                "nodes": [node],
                "verdict": "pass",
                "reason": "simulated DCGM level 3: pass",
                "shape": None,
                "measured": {"level": 3, "result": "pass", "error_ids": []},
                "command": [],
                "output": "",
            },
            {
                "check": "nic_loopback",
                "nodes": [node],
                "verdict": "pass",
                "reason": "mlx5_0 390 Gb/s, mlx5_1 390 Gb/s; floor 350 Gb/s; "
                "mlx5_0 1.5 µs, mlx5_1 1.5 µs typical latency; no ceiling in shape h100-8",
                "shape": "h100-8",
                "measured": {
                    "floor_gbps": 350.0,
                    "bw_avg_gbps": {"mlx5_0": 390.0, "mlx5_1": 390.0},
                    "bw_peak_gbps": {"mlx5_0": 390.0, "mlx5_1": 390.0},
                    "size_bytes": {"mlx5_0": 8388608, "mlx5_1": 8388608},
                    "ceiling_us": None,  # the shape sets none: reported, not judged
                    "lat_typical_us": {"mlx5_0": 1.5, "mlx5_1": 1.5},
                    "lat_p99_us": {"mlx5_0": 1.5, "mlx5_1": 1.5},
                    "lat_p999_us": {"mlx5_0": 1.5, "mlx5_1": 1.5},
                },
                "command": ["simulated", "ib_write_bw", "-d", "mlx5_0", "-s", "8388608", "localhost"],
                "output": "\n".join(
                    [
                        f"== {d} ==\nsimulated ib_write_bw loopback on {node} {d}: 390 Gb/s at 8388608 B"
                        for d in ("mlx5_0", "mlx5_1")
                    ]
                    + [
                        f"== {d} latency ==\nsimulated ib_write_lat loopback on {node} {d}: 1.5 usec typical"
                        for d in ("mlx5_0", "mlx5_1")
                    ]
                ),
            },
        ]

    assert out == {
        "schema_version": 1,
        "nodes": ["gpu-node-1", "gpu-node-2"],
        "incident": None,
        "policy": {"path": str(policy)},
        "dcgm_level": 3,
        "verdict": "pass",
        "checks": [
            *node_checks("gpu-node-1"),
            *node_checks("gpu-node-2"),
            {
                "check": "all_reduce",
                "nodes": ["gpu-node-1", "gpu-node-2"],
                "verdict": "pass",
                "reason": "busbw 360 GB/s at 8 GiB on 16 ranks, floor 300 GB/s",
                "shape": "h100-8",
                "measured": {
                    "busbw_gbps": 360.0,
                    "floor_gbps": 300.0,
                    "largest_bytes": 8589934592,
                    "avg_busbw_gbps": 144.0,
                    "ranks": 16,
                    "hosts": ["gpu-node-1", "gpu-node-2"],
                    "out_of_bounds": 0,
                    "version": None,
                },
                "command": ["simulated", "all_reduce_perf", "-b", "8", "-e", "8589934592"],
                "output": "simulated all_reduce_perf on gpu-node-1, gpu-node-2: 8 ranks each, "
                "busbw 360 GB/s at 8589934592 B",
            },
        ],
    }


def test_medic_check_deep_exit_status_says_what_it_found(
    cli: Backends, fleet: SimFleet, policy: Path
) -> None:
    drained(fleet, "gpu-node-1")
    fleet.script_hardware("gpu-node-1", lost=(6,))
    run = CliRunner()
    failed = run.invoke(app, ["check", "deep", "gpu-node-1", "--only", "gpu_count", "--policy", str(policy)])
    assert failed.exit_code == 1, failed.output
    assert "GPU 6 does not answer" in failed.stdout and "Verdict: FAIL" in failed.stdout
    in_service = run.invoke(app, ["check", "deep", "gpu-node-2", "--only", "dcgm", "--policy", str(policy)])
    assert in_service.exit_code == 3, in_service.output  # no verdict: the node is in service
    unshaped = run.invoke(app, ["check", "deep", "login-1", "--policy", str(policy)])
    assert unshaped.exit_code == 2
    assert "no shape for login-1: add a pattern matching it to deep_checks.nodes in" in unshaped.output
    unknown = run.invoke(
        app, ["check", "deep", "gpu-node-1", "--incident", "inc-nope", "--policy", str(policy)]
    )
    assert (unknown.exit_code, "no incident inc-nope in the store" in unknown.output) == (2, True)
