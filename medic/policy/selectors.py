"""Node groups' selectors: which nodes a group takes, decided on what the scheduler says of a node.

A selector's keys must all hold; within a key, any value will do, except `features`, all of which the
node must have (as a job's `--constraint=a&b`). What the scheduler does not say of a node is never
guessed: a key that needs it is unknown, and a node whose group turns on an unknown key has no group
(medic/policy/groups.py escalates its incidents).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from medic.hostlist import HostlistTooLarge, expand_hostlist
from medic.protocols import NodeInfo

# Far above any one cluster (the largest run 100,000 GPUs on ~12,500 nodes), far below what the
# loader could hold or compare group against group in a moment.
MAX_HOSTLIST_NODES = 100_000
# The name the nodes no group takes go by (in decisions, mode changes, the rollout report): no group can
# have it, group names starting with [a-z0-9].
OTHER_NODES = "*"


class Mode(StrEnum):
    """How far GPU Medic may go on a node (docs/policy.md#groups, decision 0017)."""

    OBSERVE = "observe"  # decide, record, tell "would have"; touch nothing
    CONTAIN = "contain"  # drain and move the jobs off; a repair waits for a human's approval
    REMEDIATE = "remediate"  # act as the policy says


# From the least a node may have done to it to the most: where modes must be combined, the least wins.
MODE_ORDER = (Mode.OBSERVE, Mode.CONTAIN, Mode.REMEDIATE)


def least(modes: list[Mode]) -> Mode:
    return min(modes, key=MODE_ORDER.index)


class Selector(BaseModel):
    """Which nodes a group takes. At least one key; a list given is never empty."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    partitions: list[str] | None = Field(
        None, min_length=1, description="In any of these scheduler partitions."
    )
    hostlist: list[str] | None = Field(
        None, min_length=1, description="Named by any of these Slurm hostlist expressions (gpu-node-[1-4,9])."
    )
    names: list[str] | None = Field(
        None, min_length=1, description="Named to fit any of these shell patterns (gpu-nvl72-a*)."
    )
    features: list[str] | None = Field(
        None, min_length=1, description="Has every one of these node features (Slurm's active features)."
    )
    gpu_model: list[str] | None = Field(
        None,
        min_length=1,
        description="Its GPUs are of one of these types, as gres names them (h100, gb200).",
    )
    gpus: list[PositiveInt] | None = Field(
        None, min_length=1, description="It has one of these numbers of GPUs."
    )

    @field_validator("hostlist")
    @classmethod
    def _expandable(cls, expressions: list[str] | None) -> list[str] | None:
        for expression in expressions or ():
            try:
                if not expand_hostlist(expression, MAX_HOSTLIST_NODES):
                    raise ValueError(f"hostlist {expression!r} names no node")
            except HostlistTooLarge as error:
                raise ValueError(f"hostlist {error}") from None
        return expressions

    @model_validator(mode="after")
    def _something(self) -> Selector:
        if all(value is None for value in self.model_dump().values()):
            raise ValueError(
                "an empty selector: give partitions, hostlist, names, features, gpu_model or gpus"
            )
        return self

    def hosts(self) -> frozenset[str]:
        return _expanded(tuple(self.hostlist or ()))


@functools.lru_cache(maxsize=256)
def _expanded(expressions: tuple[str, ...]) -> frozenset[str]:
    return frozenset(n for e in expressions for n in expand_hostlist(e, MAX_HOSTLIST_NODES))


@dataclass(frozen=True, slots=True)
class Match:
    """Whether a node is selected: True, False, or None when a fact it turns on is missing;
    `why` in words either way (each key that held, the one that did not, or the facts missing)."""

    selected: bool | None
    why: tuple[str, ...]


def match(selector: Selector, node: NodeInfo) -> Match:
    held: list[str] = []
    missing: list[str] = []
    for holds, said in _keys(selector, node):
        if holds is False:
            return Match(False, (said,))
        (held if holds else missing).append(said)
    if missing:
        return Match(None, tuple(missing))
    return Match(True, tuple(held))


def _keys(s: Selector, node: NodeInfo) -> list[tuple[bool | None, str]]:
    """Each key the selector gives, as (holds, in words); holds is None for a fact the scheduler did not give."""
    keys: list[tuple[bool | None, str]] = []
    if s.hostlist is not None or s.names is not None:
        listed = node.name in s.hosts()
        pattern = next((p for p in s.names or () if fnmatchcase(node.name, p)), None)
        if listed:
            keys.append((True, f"{node.name} is in hostlist {', '.join(s.hostlist or ())}"))
        elif pattern:
            keys.append((True, f"{node.name} fits {pattern}"))
        else:
            named = [*(s.hostlist or ()), *(s.names or ())]
            keys.append((False, f"{node.name} is not among {', '.join(named)}"))
    if s.partitions is not None:
        keys.append(_among("partition", node.partitions, s.partitions, every=False))
    if s.features is not None:
        keys.append(_among("feature", node.features, s.features, every=True))
    if s.gpu_model is not None:
        model = node.gpu_model
        wanted = ", ".join(s.gpu_model)
        if model is None:
            keys.append((None, "the scheduler gives no GPU model for it"))
        elif model.lower() in {m.lower() for m in s.gpu_model}:
            keys.append((True, f"GPU model {model}"))
        else:
            keys.append((False, f"GPU model {model}, not {wanted}"))
    if s.gpus is not None:
        if not node.gpus:  # no gres: a count nobody told us, not a node without GPUs
            keys.append((None, "the scheduler gives no GPU count for it"))
        elif node.gpus in s.gpus:
            keys.append((True, f"{node.gpus} GPUs"))
        else:
            keys.append((False, f"{node.gpus} GPUs, not {', '.join(map(str, s.gpus))}"))
    return keys


def _among(
    what: str, has: tuple[str, ...] | None, wanted: list[str], *, every: bool
) -> tuple[bool | None, str]:
    if has is None:
        return None, f"the scheduler gives no {what}s for it"
    shown = ", ".join(has) or "none"
    if every:
        lacking = [w for w in wanted if w not in has]
        if lacking:
            return False, f"{what}s {shown} lack {', '.join(lacking)}"
        return True, f"{what}s {', '.join(wanted)}"
    common = [w for w in wanted if w in has]
    if not common:
        return False, f"{what}s {shown}, not {', '.join(wanted)}"
    return True, f"{what} {', '.join(common)}"


def overlap(a: Selector, b: Selector) -> str | None:
    """Why the nodes one selector takes are sure to fit the other too, as far as the policy alone shows
    it: one selector names no kind of fact the other does not, and on each they both name they agree
    (a partition in common, features one's a subset of the other's, a node both name). None when the
    file cannot tell (one by hostlist, one by feature; two partitions): a node that fits both is
    caught when it is met, and its incident escalates."""
    mine, theirs = _kinds(a), _kinds(b)
    if not (mine <= theirs or theirs <= mine):
        return None
    names = _names_meet(a, b)
    if names is None:
        return None
    shared: list[str] = [names] if names else []
    for key, every in (("partitions", False), ("features", True), ("gpu_model", False), ("gpus", False)):
        mine, theirs = getattr(a, key), getattr(b, key)
        if mine is None or theirs is None:
            continue
        if every:
            if not (set(mine) <= set(theirs) or set(theirs) <= set(mine)):
                return None
            shared.append(f"features {', '.join(sorted(set(mine) | set(theirs)))}")
            continue
        common = sorted({str(v).lower() for v in mine} & {str(v).lower() for v in theirs})
        if not common:
            return None
        shared.append(f"{key.rstrip('s').replace('_', ' ')} {', '.join(common)}")
    return "; ".join(shared) or "both select every node"


def _kinds(s: Selector) -> frozenset[str]:
    """The kinds of facts a selector turns on; hostlist and names are both the node's name."""
    given = {k for k, v in s.model_dump().items() if v is not None}
    return frozenset("name" if k in ("hostlist", "names") else k for k in given)


def _names_meet(a: Selector, b: Selector) -> str | None:
    """A name both selectors take ("" when either takes any name), or None when none is sure to be."""
    if (a.hostlist is None and a.names is None) or (b.hostlist is None and b.names is None):
        return ""
    common = sorted(a.hosts() & b.hosts())
    if common:
        return f"both name {common[0]}"
    for hosts, patterns in ((a.hosts(), b.names or ()), (b.hosts(), a.names or ())):
        for pattern in patterns:
            hit = next((h for h in sorted(hosts) if fnmatchcase(h, pattern)), None)
            if hit is not None:
                return f"{hit} is named by one and fits {pattern}"
    for mine in a.names or ():
        for theirs in b.names or ():
            # A pattern that, read as a name, fits the other shares its names (gpu-node-* and gpu-*).
            if mine == theirs or fnmatchcase(mine, theirs) or fnmatchcase(theirs, mine):
                return f"patterns {mine} and {theirs} take the same names"
    return None
