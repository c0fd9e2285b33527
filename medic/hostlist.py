"""Slurm hostlist expressions: "gpu-node-[1-2,4],login1" names gpu-node-1, gpu-node-2, gpu-node-4, login1.

Read by the Slurm backend (job exclusions, topology) and by the policy's node groups, which is why it
lives in the domain rather than beside the scheduler.
"""

from __future__ import annotations

import math
import re

_PARTS = re.compile(r"(?:[^,\[]|\[[^\]]*\])+")
_BRACKETS = re.compile(r"\[([^\]]*)\]")


class HostlistTooLarge(ValueError):
    """Raised when an expression names more nodes than the caller allows."""


def expand_hostlist(expression: str, limit: int | None = None) -> tuple[str, ...]:
    """The names an expression stands for, in its order. ValueError for a range that is not one;
    HostlistTooLarge past `limit` names, counted before any is made (a policy's `gpu-[1-999999999]`
    must not fill memory)."""
    parts = [p.strip() for p in _PARTS.findall(expression)]
    if limit is not None:
        size = sum(math.prod(_ranges_size(m) for m in _BRACKETS.findall(p)) for p in parts)
        if size > limit:
            raise HostlistTooLarge(f"{expression!r} names {size} nodes; at most {limit}")
    names: list[str] = []
    for part in parts:
        names.extend(_expand_one(part))
    return tuple(n for n in names if n)


def _ranges(inside: str, part: str) -> list[tuple[str, int, int]]:
    """The ranges of one bracket, as (first as written, first, last)."""
    ranges = []
    for item in inside.split(","):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"not a hostlist range: {item!r} in {part!r}")
        ranges.append((low, int(low), int(high or low)))
    return ranges


def _ranges_size(inside: str) -> int:
    return sum(max(0, last - first + 1) for _, first, last in _ranges(inside, inside))


def _expand_one(part: str) -> list[str]:
    match = _BRACKETS.search(part)
    if not match:
        return [part]
    head, tail = part[: match.start()], part[match.end() :]
    out: list[str] = []
    for low, first, last in _ranges(match.group(1), part):
        for number in range(first, last + 1):
            out.extend(_expand_one(f"{head}{number:0{len(low)}d}{tail}"))
    return out
