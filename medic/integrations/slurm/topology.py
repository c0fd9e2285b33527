"""Slurm's network topology: `scontrol show topology` output and topology.conf, as a medic `Topology`.

Both are lines of `Key=Value` words, one switch per line (topology/tree plugin):

    SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=gpu-node-[1-4]           (scontrol show topology)
    SwitchName=spine1 Level=1 LinkSpeed=1 Nodes=gpu-node-[1-7] Switches=leaf[1-2]
    SwitchName=leaf1 Nodes=gpu-node-[1-4]                               (topology.conf)
    SwitchName=spine1 Switches=leaf[1-2]

`scontrol` gives each switch its level and lists every node below it; topology.conf gives neither,
so a switch's level is worked out from the switches below it. Node and switch lists are hostlist
expressions. Unknown keys (`LinkSpeed`, newer releases' additions) are ignored.
"""

from __future__ import annotations

import shlex

from medic.hostlist import expand_hostlist
from medic.integrations.slurm.cli import SlurmCli
from medic.topology import Switch, Topology


class TopologyFormatError(ValueError):
    """Raised when a topology line is not `SwitchName=... Key=Value ...`."""


def _fields(line: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for word in shlex.split(line, comments=True):
        key, sep, value = word.partition("=")
        if not sep:
            raise TopologyFormatError(f"not Key=Value: {word!r} in {line!r}")
        fields[key.lower()] = value
    return fields


def parse(text: str) -> list[Switch]:
    """The switches of `scontrol show topology` output or of a topology.conf."""
    raw: list[tuple[str, int | None, tuple[str, ...], tuple[str, ...]]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = _fields(line)
        if not fields:
            continue  # blank or comment
        name = fields.get("switchname")
        if not name:
            raise TopologyFormatError(f"line {number}: no SwitchName in {line.strip()!r}")
        level = fields.get("level")
        if level is not None and not level.isdigit():
            raise TopologyFormatError(f"line {number}: Level={level!r} is not a number")
        try:
            nodes = expand_hostlist(fields.get("nodes", ""))
            below = expand_hostlist(fields.get("switches", ""))
        except ValueError as error:
            raise TopologyFormatError(f"line {number}: {error}") from None
        raw.append((name, None if level is None else int(level), nodes, below))
    children = {name: below for name, _, _, below in raw}
    return [
        Switch(name, level if level is not None else _level(name, children), nodes, below)
        for name, level, nodes, below in raw
    ]


def _level(name: str, children: dict[str, tuple[str, ...]], depth: int = 0) -> int:
    if depth > len(children):
        raise TopologyFormatError(f"switch {name} is below itself")
    below = [c for c in children.get(name, ()) if c in children]
    return 1 + max(_level(c, children, depth + 1) for c in below) if below else 0


def topology(text: str) -> Topology:
    return Topology.of(parse(text))


def read(cli: SlurmCli) -> Topology:
    """The live cluster's topology (Slurm configured with a topology plugin)."""
    return topology(cli.scontrol("show", "topology"))
