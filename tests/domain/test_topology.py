"""The cluster's topology: Slurm's formats (medic/integrations/slurm/topology.py) and the model (medic/topology.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from checkout import REPO_ROOT, TEST_FIXTURES
from factories import fault_event

from medic.culprit import differential
from medic.incidents import correlate
from medic.integrations.slurm.topology import TopologyFormatError, parse, topology
from medic.policy import load_policy
from medic.topology import Switch, Topology, load_map

SAMPLES = TEST_FIXTURES / "topology"  # captured from Slurm 22.05 (README.md there)
SHOWN = (SAMPLES / "scontrol-show-topology-22.05.txt").read_text()
CONFIGURED = (SAMPLES / "topology-22.05.conf").read_text()
LEAVES = {
    **{f"gpu-node-{i}": "leaf1" for i in range(1, 5)},
    **{f"gpu-node-{i}": "leaf2" for i in range(5, 8)},
    "gpu-node-8": "leaf3",
}


def test_scontrol_show_topology_gives_each_node_its_leaf() -> None:
    assert dict(topology(SHOWN).leaf_of) == LEAVES


def test_topology_conf_gives_the_same_leaves_and_works_out_the_levels() -> None:
    assert dict(topology(CONFIGURED).leaf_of) == LEAVES
    levels = {s.name: s.level for s in parse(CONFIGURED)}
    assert levels == {s.name: s.level for s in parse(SHOWN)}
    assert levels == {"leaf1": 0, "leaf2": 0, "leaf3": 0, "spine1": 1, "spine2": 1, "core": 2}


def test_switches_keep_what_slurm_said() -> None:
    spine = next(s for s in parse(SHOWN) if s.name == "spine1")
    assert spine == Switch("spine1", 1, tuple(f"gpu-node-{i}" for i in range(1, 8)), ("leaf1", "leaf2"))


def test_switch_sizes_and_neighbours() -> None:
    model = topology(SHOWN)
    assert model.switch_sizes() == {"leaf1": 4, "leaf2": 3, "leaf3": 1}
    assert model.neighbours("gpu-node-6") == ["gpu-node-5", "gpu-node-7"]
    assert model.neighbours("unknown") == []


@pytest.mark.parametrize(
    "text",
    [
        "SwitchName=s0 Nodes=tux[a-3]",
        "Level=0 Nodes=tux1",
        "SwitchName=s0 Level=x Nodes=tux1",
        "SwitchName=s0 junk",
    ],
    ids=["bad hostlist", "no name", "bad level", "no equals sign"],
)
def test_malformed_lines_say_which(text: str) -> None:
    with pytest.raises(TopologyFormatError, match=r"line 1|not Key=Value"):
        parse(text)


def test_a_switch_below_itself_is_refused() -> None:
    with pytest.raises(TopologyFormatError, match="below itself"):
        parse("SwitchName=a Switches=b\nSwitchName=b Switches=a")


def test_comments_and_blank_lines_are_skipped() -> None:
    assert [s.name for s in parse("# leaves\n\nSwitchName=s0 Nodes=tux[0-1]  # rack 1\n")] == ["s0"]


def test_the_config_map_for_other_schedulers() -> None:
    model = load_map("switches:\n  leaf-1: [gpu-001, gpu-002]\n  leaf-2: [gpu-003]\n")
    assert dict(model.leaf_of) == {"gpu-001": "leaf-1", "gpu-002": "leaf-1", "gpu-003": "leaf-2"}
    with pytest.raises(ValueError, match="two leaf switches"):
        load_map("switches:\n  a: [n1]\n  b: [n1]\n")
    with pytest.raises(ValueError):
        load_map("leaves: {}\n")
    assert load_map("") == Topology()


def test_an_event_without_a_switch_gets_its_node_s_leaf() -> None:
    model = topology(SHOWN)
    placed = model.place(fault_event("nccl_timeout", node="gpu-node-2"))
    assert placed.switch == "leaf1"
    assert model.place(fault_event("nccl_timeout", node="gpu-node-2", switch="rack-9")).switch == "rack-9"
    assert model.place(fault_event("nccl_timeout", node="elsewhere")).switch is None


def test_placed_timeouts_make_the_switch_storm_that_unplaced_ones_never_could() -> None:
    policy = load_policy(REPO_ROOT / "policies" / "default.yaml").policy
    model = topology(SHOWN)
    timeouts = [fault_event("nccl_timeout", node=f"gpu-node-{i}", seconds=i) for i in range(1, 5)]
    window = policy.defaults.incident_window_minutes
    unplaced = correlate(timeouts, timedelta(minutes=window), policy.storms(model.switch_sizes()))
    assert {i.scope for i in unplaced} == {"node"} and len(unplaced) == 4
    placed = differential(timeouts, model)
    [storm] = correlate(placed, timedelta(minutes=window), policy.storms(model.switch_sizes()))
    assert (storm.scope, storm.node, len(storm.nodes)) == ("switch", "leaf1", 4)
