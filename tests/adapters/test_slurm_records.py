"""Reading Slurm's `--json` documents of every generation, 22.05 (v0.0.38) to 26.11 (v0.0.46), and
failing closed on anything unreadable. Fixtures and where they come from: tests/fixtures/slurm/SOURCES.md.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from checkout import TEST_FIXTURES

from medic.errors import PermanentError
from medic.hostlist import expand_hostlist
from medic.integrations.slurm import SlurmScheduler
from medic.integrations.slurm.cli import SlurmCli
from medic.integrations.slurm.errors import (
    NodeHeldByOthersError,
    ResumeRefusedError,
    UnreadableSlurmDataError,
    UnsupportedSlurmFormatError,
)
from medic.integrations.slurm.records import GENERATIONS, generation, parse_jobs, parse_nodes
from medic.protocols import JobState, NodeState

FIXTURES = TEST_FIXTURES / "slurm"
NEWER = [g for g in GENERATIONS if g >= 39]


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def nodes_of(name: str) -> dict[str, tuple[NodeState, str | None]]:
    return {n.name: (n.state, n.reason) for n in parse_nodes(load(name))}


# --- 22.05: documents recorded on our cluster -------------------------------------------------


def test_2205_recorded_nodes() -> None:
    assert generation(load("v0.0.38-sinfo-a.json")) == 38
    assert nodes_of("v0.0.38-sinfo-a.json") == {
        "gpu-node-1": (NodeState.DRAINED, "admin: bad fan"),  # allocated + DRAIN: draining
        "gpu-node-2": (NodeState.ALLOCATED, None),
        "gpu-node-3": (NodeState.ALLOCATED, None),  # mixed
        "gpu-node-4": (NodeState.DOWN, "admin: psu swap"),
    }
    assert nodes_of("v0.0.38-sinfo-b.json") == {
        "gpu-node-1": (NodeState.DRAINED, "admin: bad fan"),
        "gpu-node-2": (NodeState.DRAINED, "medic: xid 79 on GPU 3 incident T1"),
        "gpu-node-3": (NodeState.ALLOCATED, None),
        "gpu-node-4": (NodeState.DOWN, "admin: psu swap"),  # down + DRAIN
    }
    assert nodes_of("v0.0.38-sinfo-c.json")["gpu-node-3"] == (NodeState.REBOOTING, "medic: reboot incident 7")
    assert nodes_of("v0.0.38-sinfo-d.json") == {
        "gpu-node-1": (NodeState.DRAINED, "admin: bad fan"),
        "gpu-node-2": (NodeState.UNKNOWN, None),  # idle* (NOT_RESPONDING)
        "gpu-node-3": (NodeState.IDLE, None),
        "gpu-node-4": (NodeState.DOWN, "admin: psu swap"),
    }
    assert {n.gpus for n in parse_nodes(load("v0.0.38-sinfo-a.json"))} == {8}


def test_2205_recorded_jobs() -> None:
    jobs = {j.id: j for j in parse_jobs(load("v0.0.38-squeue.json"))}
    assert {i: (j.state, j.job_state, j.nodes, j.owner) for i, j in jobs.items()} == {
        "1": ("RUNNING", JobState.RUNNING, ("gpu-node-1", "gpu-node-2"), "alice"),
        "2": ("RUNNING", JobState.RUNNING, ("gpu-node-3",), "nobody"),
        "3": ("PENDING", JobState.PENDING, (), "nobody"),
    }


# --- 23.02 and later: scontrol show nodes / squeue documents per generation ---------------------

EXPECTED_NODES = {
    "gpu-node-1": (NodeState.IDLE, None),
    "gpu-node-2": (NodeState.ALLOCATED, None),
    "gpu-node-3": (NodeState.ALLOCATED, None),  # MIXED
    "gpu-node-4": (NodeState.DRAINED, "admin: bad fan"),
    "gpu-node-5": (NodeState.DRAINED, "admin: bad fan"),  # ALLOCATED + DRAIN: draining
    "gpu-node-6": (NodeState.DOWN, "admin: psu swap"),  # DOWN + DRAIN
    "gpu-node-7": (NodeState.DOWN, "Not responding"),
    "gpu-node-8": (NodeState.UNKNOWN, None),  # IDLE + NOT_RESPONDING
    "gpu-node-9": (NodeState.DRAINED, "medic: xid 79 on GPU 3 incident T1"),
    "gpu-node-10": (NodeState.REBOOTING, "medic: reboot incident 7"),
    "gpu-node-11": (NodeState.REBOOTING, "medic: reboot incident 7 : reboot issued"),
}


@pytest.mark.parametrize("gen", NEWER)
def test_nodes_of_each_generation(gen: int) -> None:
    doc = load(f"v0.0.{gen}-scontrol-show-nodes.json")
    assert generation(doc) == gen
    assert nodes_of(f"v0.0.{gen}-scontrol-show-nodes.json") == EXPECTED_NODES
    admin = next(n for n in parse_nodes(doc) if n.name == "gpu-node-4")
    assert admin.held_by_others and admin.out_of_service and not admin.info().drained_by_medic


@pytest.mark.parametrize("gen", NEWER)
def test_jobs_of_each_generation(gen: int) -> None:
    jobs = parse_jobs(load(f"v0.0.{gen}-squeue.json"))
    assert [(j.id, j.state, j.job_state, j.nodes, j.owner, j.restarts, j.excluded) for j in jobs] == [
        ("11", "RUNNING", JobState.RUNNING, ("gpu-node-2", "gpu-node-5"), "alice", 0, ""),
        ("12", "COMPLETING", JobState.RUNNING, ("gpu-node-3",), "nobody", 1, ""),
        ("13", "PENDING", JobState.PENDING, (), "nobody", 2, "gpu-node-4"),
        ("14", "REQUEUED", JobState.PENDING, (), "nobody", 1, ""),
    ]


# --- the issue: a 24.11 node an admin drained ----------------------------------------------------


class FakeCli(SlurmCli):
    """Answers sinfo/scontrol/squeue with fixture documents; records every scontrol change."""

    def __init__(self, docs: dict[str, dict[str, Any]], topology: str = "") -> None:
        super().__init__()
        self.docs = docs
        self.topology = topology  # `scontrol show topology` prints nothing without a topology plugin
        self.changes: list[tuple[str, ...]] = []

    def run(self, *args: str) -> str:
        if args[:2] == ("scontrol", "--json"):
            return json.dumps(self.docs["scontrol"])
        if args == ("scontrol", "show", "topology"):
            return self.topology
        if args[0] == "scontrol":
            self.changes.append(args)
            return ""
        return json.dumps(self.docs[args[0]])


def test_each_node_carries_its_leaf_switch_from_slurms_topology() -> None:
    """The switch-storm correlation needs every node's leaf: `scontrol show topology` (recorded on
    Slurm 22.05, tests/fixtures/topology) gives it; read once per TOPOLOGY_TTL_S, not per call."""
    recorded = (TEST_FIXTURES / "topology" / "scontrol-show-topology-22.05.txt").read_text()
    cli = _cli_2411(recorded)
    asked = []
    original = cli.run
    cli.run = lambda *args: asked.append(args) or original(*args)  # type: ignore[method-assign]
    scheduler = SlurmScheduler(cli)
    leaves = {n.name: n.switch for n in scheduler.nodes()}
    assert leaves == {f"gpu-node-{i}": "leaf1" if i <= 4 else "leaf2" if i <= 7 else "leaf3" if i == 8 else None
                      for i in range(1, 12)}  # fmt: skip
    assert scheduler.node("gpu-node-5").switch == "leaf2"
    assert asked.count(("scontrol", "show", "topology")) == 1
    assert SlurmScheduler(_cli_2411()).node("gpu-node-5").switch is None  # no topology plugin


def _cli_2411(topology: str = "") -> FakeCli:
    sinfo = {
        "sinfo": [],
        "meta": load("v0.0.42-scontrol-show-nodes.json")["meta"],
        "errors": [],
        "warnings": [],
    }
    return FakeCli(
        {
            "sinfo": sinfo,
            "scontrol": load("v0.0.42-scontrol-show-nodes.json"),
            "squeue": load("v0.0.42-squeue.json"),
        },
        topology,
    )


def test_2411_admin_drain_is_neither_overwritten_nor_undone() -> None:
    cli = _cli_2411()
    scheduler = SlurmScheduler(cli)
    info = scheduler.node("gpu-node-4")
    assert (info.state, info.reason, info.drained_by_medic) == (NodeState.DRAINED, "admin: bad fan", False)
    with pytest.raises(NodeHeldByOthersError, match="admin: bad fan"):
        scheduler.drain("gpu-node-4", "medic: xid 79")
    with pytest.raises(ResumeRefusedError, match="admin"):
        scheduler.resume("gpu-node-4")
    assert cli.changes == []
    scheduler.drain("gpu-node-1", "medic: xid 79")  # an idle node is drained as before
    assert cli.changes == [
        ("scontrol", "update", "nodename=gpu-node-1", "state=drain", "reason=medic: xid 79")
    ]


def test_2411_jobs_on_a_node_are_seen() -> None:
    scheduler = SlurmScheduler(_cli_2411())
    assert [(j.id, j.nodes) for j in scheduler.jobs_on_node("gpu-node-5")] == [
        ("11", ("gpu-node-2", "gpu-node-5"))
    ]
    assert [j.id for j in scheduler.jobs_on_node("gpu-node-3")] == ["12"]  # still completing there


def test_2205_cli_reads_sinfo_only() -> None:
    cli = FakeCli({"sinfo": load("v0.0.38-sinfo-b.json"), "squeue": load("v0.0.38-squeue.json")})
    assert cli.node("gpu-node-1").info().reason == "admin: bad fan"


# --- fail closed -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("meta", "field"),
    [
        (
            {"plugin": {"type": "", "name": "", "data_parser": "data_parser/v0.0.99"}},
            "meta.plugin.data_parser",
        ),
        ({"plugins": {"data_parser": "data_parser/v0.0.37"}}, "meta.plugins.data_parser"),
        ({"plugin": {"type": "openapi/v0.0.37", "name": "Slurm OpenAPI v0.0.37"}}, "meta.plugin.type"),
        ({"slurm": {"version": {"major": "30", "minor": "05", "micro": "1"}}}, "meta"),
        ({}, "meta"),
    ],
)
def test_unknown_generation_is_refused(meta: dict[str, Any], field: str) -> None:
    doc = load("v0.0.42-scontrol-show-nodes.json") | {"meta": meta}
    with pytest.raises(UnsupportedSlurmFormatError) as caught:
        parse_nodes(doc)
    assert caught.value.field == field
    assert isinstance(caught.value, PermanentError)
    assert "GPU Medic does not act on it" in str(caught.value)


def test_version_alone_picks_the_generation() -> None:
    doc = load("v0.0.42-scontrol-show-nodes.json")
    doc["meta"] = {"slurm": {"version": {"major": "24", "minor": "11", "micro": "7"}}}
    assert generation(doc) == 42


def _mutated(gen: int, node: str, **fields: Any) -> dict[str, Any]:
    name = "v0.0.38-sinfo-b.json" if gen == 38 else f"v0.0.{gen}-scontrol-show-nodes.json"
    doc = copy.deepcopy(load(name))
    raw = next(n for n in doc["nodes"] if n["name"] == node)
    raw.update(fields)
    return doc


@pytest.mark.parametrize(
    ("gen", "fields", "detail"),
    [
        (42, {"state": "idle"}, "not the list of state words"),  # a 22.05 shape in a 24.11 document
        (42, {"state": ["IDLE", "DRAINED_BY_ROBOT"]}, "DRAINED_BY_ROBOT"),
        (42, {"state": ["DRAIN"]}, "0 base states"),
        (42, {"state": []}, "0 base states"),
        (39, {"state": None}, "not the list of state words"),
        (38, {"state": ["IDLE", "DRAIN"]}, "not v0.0.38's string and list"),  # the misreading
        (38, {"state_flags": "DRAIN"}, "not v0.0.38's string and list"),
        (42, {"reason": {"description": "admin: bad fan"}}, "not a string"),
    ],
)
def test_unreadable_node_state_fails_closed(gen: int, fields: dict[str, Any], detail: str) -> None:
    with pytest.raises(UnreadableSlurmDataError, match=detail) as caught:
        parse_nodes(_mutated(gen, "gpu-node-1", **fields))
    assert "node gpu-node-1" in str(caught.value)
    assert caught.value.field in ("state", "reason")


def test_missing_node_state_fails_closed() -> None:
    doc = _mutated(42, "gpu-node-4")
    del next(n for n in doc["nodes"] if n["name"] == "gpu-node-4")["state"]
    with pytest.raises(UnreadableSlurmDataError, match="node gpu-node-4: state is missing"):
        parse_nodes(doc)


def test_unreadable_node_stops_the_scheduler() -> None:
    cli = _cli_2411()
    cli.docs["scontrol"] = _mutated(42, "gpu-node-4", state={"current": "DRAIN"})
    scheduler = SlurmScheduler(cli)
    for call in (
        lambda: scheduler.drain("gpu-node-4", "medic: x"),
        lambda: scheduler.resume("gpu-node-4"),
        lambda: scheduler.jobs_on_node("gpu-node-4"),
    ):
        with pytest.raises(UnreadableSlurmDataError, match="gpu-node-4"):
            call()
    assert cli.changes == []


def test_a_2411_sinfo_document_is_not_taken_for_nodes() -> None:
    doc = {"sinfo": [], "meta": load("v0.0.42-scontrol-show-nodes.json")["meta"], "errors": []}
    with pytest.raises(UnreadableSlurmDataError, match="nodes"):
        parse_nodes(doc)


def _job_doc(gen: int, job_id: int, **fields: Any) -> dict[str, Any]:
    doc = copy.deepcopy(load(f"v0.0.{gen}-squeue.json"))
    next(j for j in doc["jobs"] if j["job_id"] == job_id).update(fields)
    return doc


@pytest.mark.parametrize(
    ("gen", "fields", "field"),
    [
        (42, {"job_state": "RUNNING"}, "job_state"),  # 23.02's string in a 24.11 document
        (39, {"job_state": ["RUNNING"]}, "job_state"),
        (42, {"job_state": ["RUNNING", "WARP_SPEED"]}, "job_state"),
        (42, {"job_resources": {"nodes": "gpu-node-[2,5]"}}, "job_resources.nodes.allocation[].name"),
        (
            40,
            {"job_resources": {"allocated_nodes": [{"name": "gpu-node-2"}]}},
            "job_resources.allocated_nodes[].nodename",
        ),
        (
            42,
            {"job_resources": {"nodes": {"allocation": []}}, "nodes": ""},
            "job_resources",
        ),  # running, no nodes
    ],
)
def test_unreadable_job_fails_closed(gen: int, fields: dict[str, Any], field: str) -> None:
    with pytest.raises(UnreadableSlurmDataError, match="job 11") as caught:
        parse_jobs(_job_doc(gen, 11, **fields))
    assert caught.value.field == field


def test_job_nodes_fall_back_to_the_hostlist() -> None:
    doc = _job_doc(38, 1)
    next(j for j in doc["jobs"] if j["job_id"] == 1)["job_resources"]["allocated_nodes"] = []
    # what 22.05 writes when slurmctld sent no core layout
    assert next(j for j in parse_jobs(doc) if j.id == "1").nodes == ("gpu-node-1", "gpu-node-2")


def test_expand_hostlist() -> None:
    assert expand_hostlist("gpu-node-[1-3,7],login1,n[08-10]") == (
        "gpu-node-1", "gpu-node-2", "gpu-node-3", "gpu-node-7", "login1", "n08", "n09", "n10"
    )  # fmt: skip
    assert expand_hostlist("") == ()


def test_what_node_groups_select_on_is_read_and_what_is_not_given_stays_unknown() -> None:
    """Partitions, features and the GPU type, for the policy's node groups (decision 0017)."""
    (recorded, *_) = [n.info() for n in parse_nodes(load("v0.0.38-sinfo-a.json"))]
    assert (recorded.partitions, recorded.features, recorded.gpu_model, recorded.gpus) == (
        ("gpu",),
        (),
        None,
        8,
    )
    doc = _mutated(
        44,
        "gpu-node-1",
        partitions=["gpu", "all"],
        features=["nvl72"],
        active_features=["nvl72", "rack-a"],
        gres="gpu:gb200:4(S:0-1)",
    )
    racked = next(n.info() for n in parse_nodes(doc) if n.name == "gpu-node-1")
    assert (racked.partitions, racked.features, racked.gpu_model, racked.gpus) == (
        ("gpu", "all"),
        ("nvl72", "rack-a"),  # the active ones: what a job's --constraint matches
        "gb200",
        4,
    )
    # The trimmed 25.11 record names none of them: unknown, never taken for "none".
    other = next(n.info() for n in parse_nodes(doc) if n.name != "gpu-node-1")
    assert (other.partitions, other.features, other.gpu_model) == (None, None, None)
    odd = _mutated(44, "gpu-node-1", partitions={"name": "gpu"}, gres="gpu:a100:4,gpu:h100:4")
    mixed = next(n.info() for n in parse_nodes(odd) if n.name == "gpu-node-1")
    assert (mixed.partitions, mixed.gpu_model, mixed.gpus) == (None, None, 8)
