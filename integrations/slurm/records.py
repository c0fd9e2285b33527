"""Slurm's node and job records as `sinfo --json` / `squeue --json` (OpenAPI v0.0.38, Slurm 22.05)
report them, and how they map onto the protocol's NodeInfo and JobInfo.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from medic.protocols import JobInfo, JobState, NodeInfo, NodeState

# Drains we make carry this prefix (see NodeInfo.drained_by_medic); anything else belongs to others.
MEDIC_PREFIX = "medic:"

# A gres entry: "gpu:8", "gpu:a100:8", "gpu:a100:8(S:0-1)".
_GPU_GRES = re.compile(r"^gpu(?::[^:(]+)?:(\d+)")
# "owner=alice" anywhere in a job comment, separated by spaces, commas or semicolons.
_OWNER = re.compile(r"(?:^|[\s,;])owner=([^\s,;]+)")

# squeue reports a flag instead of the base state while one is set (COMPLETING, REQUEUED, ...).
_JOB_STATES: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "SPECIAL_EXIT": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "CONFIGURING": JobState.RUNNING,
    "SUSPENDED": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STOPPED": JobState.RUNNING,
    # Its processes are still ending on its nodes (also right after a requeue): it still holds them.
    "COMPLETING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "COMPLETED": JobState.COMPLETED,
    "CANCELLED": JobState.CANCELLED,
    "REVOKED": JobState.CANCELLED,
}


def is_ours(reason: str | None) -> bool:
    return (reason or "").startswith(MEDIC_PREFIX)


@dataclass(frozen=True, slots=True)
class SlurmNode:
    name: str
    base: str  # idle, allocated, mixed, down, error, future, unknown
    flags: frozenset[str]  # DRAIN, FAIL, REBOOT_REQUESTED, REBOOT_ISSUED, NOT_RESPONDING, ...
    reason: str | None  # as set, without the " [user@time]" that scontrol shows
    gpus: int

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SlurmNode:
        return cls(
            name=raw["name"],
            base=str(raw.get("state", "unknown")).lower(),
            flags=frozenset(str(f).upper() for f in raw.get("state_flags") or ()),
            reason=raw.get("reason") or None,
            gpus=gpu_count(raw.get("gres") or ""),
        )

    @property
    def state(self) -> NodeState:
        flags = self.flags
        if "REBOOT_ISSUED" in flags:
            return NodeState.REBOOTING
        if self.base in ("down", "error"):
            return NodeState.DOWN
        # FAIL is "out of service, running work may finish", which is what drained means here.
        if flags & {"DRAIN", "FAIL"}:
            return NodeState.DRAINED
        if "REBOOT_REQUESTED" in flags:
            return NodeState.REBOOTING
        if "NOT_RESPONDING" in flags:
            return NodeState.UNKNOWN
        if self.base in ("allocated", "mixed") or "COMPLETING" in flags:
            return NodeState.ALLOCATED
        if self.base == "idle":
            return NodeState.IDLE
        return NodeState.UNKNOWN

    @property
    def out_of_service(self) -> bool:
        """Drained, failed, down or rebooting: Slurm gives it no new work."""
        return self.state in (NodeState.DRAINED, NodeState.DOWN, NodeState.REBOOTING)

    @property
    def held_by_others(self) -> bool:
        return self.out_of_service and not is_ours(self.reason)

    @property
    def describe(self) -> str:
        return "+".join([self.base.upper(), *sorted(self.flags)])

    def info(self) -> NodeInfo:
        return NodeInfo(name=self.name, state=self.state, reason=self.reason, gpus=self.gpus)


def gpu_count(gres: str) -> int:
    total = 0
    for entry in gres.split(","):
        match = _GPU_GRES.match(entry.strip())
        if match:
            total += int(match.group(1))
    return total


@dataclass(frozen=True, slots=True)
class SlurmJob:
    id: str
    state: str  # squeue's job_state, e.g. RUNNING, PENDING, COMPLETING
    user: str
    comment: str
    nodes: tuple[str, ...]  # the nodes it holds (or last held); empty while pending
    restarts: int
    excluded: str  # its ExcNodeList as a Slurm hostlist expression, "" for none

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SlurmJob:
        allocated = (raw.get("job_resources") or {}).get("allocated_nodes") or ()
        return cls(
            id=str(raw["job_id"]),
            state=str(raw.get("job_state", "")).upper(),
            user=raw.get("user_name") or str(raw.get("user_id", "")),
            comment=raw.get("comment") or "",
            nodes=tuple(n["nodename"] for n in allocated),
            restarts=int(raw.get("restart_cnt") or 0),
            excluded=raw.get("excluded_nodes") or "",
        )

    @property
    def job_state(self) -> JobState:
        # Every other end state (TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED, ...) is a failure.
        return _JOB_STATES.get(self.state, JobState.FAILED)

    @property
    def owner(self) -> str:
        """Whom to tell: an `owner=` in the job's comment (shared service accounts), else the Slurm user."""
        match = _OWNER.search(self.comment)
        return match.group(1) if match else self.user

    def info(self) -> JobInfo:
        # Slurm knows nothing of training steps: step stays None.
        return JobInfo(
            id=self.id, state=self.job_state, nodes=self.nodes, owner=self.owner, restarts=self.restarts
        )
