"""The cluster's network: which leaf switch each node hangs off.

Correlation calls trouble from many nodes under one leaf switch a switch storm (medic/incidents.py),
which needs each event's `switch` and each switch's size. Sources rarely know the switch (a
training rank does not), so events without one get their node's leaf here. The topology comes
from the scheduler (Slurm's `scontrol show topology`, medic/integrations/slurm/topology.py) or, for
other schedulers, a YAML config map:

    switches:
      leaf-1: [gpu-001, gpu-002, gpu-003, gpu-004]
      leaf-2: [gpu-005, gpu-006]

Pure: text or switches in, a `Topology` out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import yaml
from pydantic import BaseModel, ConfigDict, Field

from medic.events import FaultEvent
from medic.protocols import NodeInfo


@dataclass(frozen=True, slots=True)
class Switch:
    """One switch: the nodes below it (at any depth) and the switches directly below it."""

    name: str
    level: int  # 0 for a leaf
    nodes: tuple[str, ...] = ()
    switches: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Topology:
    leaf_of: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, switches: Iterable[Switch]) -> Topology:
        """Each node's leaf is the lowest-level switch that lists it (upper levels list every node below)."""
        best: dict[str, tuple[int, str]] = {}
        for switch in switches:
            for node in switch.nodes:
                if node not in best or (switch.level, switch.name) < best[node]:
                    best[node] = (switch.level, switch.name)
        return cls({node: name for node, (_, name) in best.items()})

    @classmethod
    def of_nodes(cls, nodes: Iterable[NodeInfo]) -> Topology:
        """The leaves a scheduler reports for its nodes (`NodeInfo.switch`)."""
        return cls({node.name: node.switch for node in nodes if node.switch})

    def switch_of(self, node: str) -> str | None:
        return self.leaf_of.get(node)

    def switch_sizes(self) -> Counter[str]:
        """Nodes per leaf switch: what a storm's `fraction_at_least` is taken of."""
        return Counter(self.leaf_of.values())

    def neighbours(self, node: str) -> list[str]:
        """The other nodes under the node's leaf switch."""
        leaf = self.leaf_of.get(node)
        return sorted(n for n, s in self.leaf_of.items() if s == leaf and n != node) if leaf else []

    def place(self, event: FaultEvent) -> FaultEvent:
        """The event with its node's leaf switch, unless it names one already or the node is unknown."""
        leaf = self.leaf_of.get(event.node)
        if event.switch is not None or leaf is None:
            return event
        return event.model_copy(update={"switch": leaf})


class TopologyMap(BaseModel):
    """The YAML config map: leaf switch name → its nodes."""

    model_config = ConfigDict(extra="forbid")

    switches: dict[str, list[str]] = Field(default_factory=dict)


def load_map(text: str) -> Topology:
    """A topology from its YAML config map; raises ValueError (pydantic's, or YAML's) when malformed."""
    document = TopologyMap.model_validate(yaml.safe_load(text) or {})
    seen: dict[str, str] = {}
    for leaf, nodes in document.switches.items():
        for node in nodes:
            if seen.setdefault(node, leaf) != leaf:
                raise ValueError(f"node {node} is under two leaf switches: {seen[node]} and {leaf}")
    return Topology(seen)
