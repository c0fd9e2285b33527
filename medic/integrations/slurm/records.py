"""Slurm's node and job records as its client tools print them with `--json`, for every JSON generation
from Slurm 22.05 on, and how they map onto the protocol's NodeInfo and JobInfo.

Each document names its own generation in its `meta` block, and that alone picks how it is read:

| Slurm | generation | where it says so | node `state` | job `job_state` | a job's nodes |
| --- | --- | --- | --- | --- | --- |
| 22.05 | v0.0.38 | `meta.plugin.type` "openapi/v0.0.38" | "idle" + `state_flags` | "RUNNING" | `job_resources.allocated_nodes[].nodename` |
| 23.02 | v0.0.39 | `meta.plugins.data_parser` | ["IDLE", "DRAIN"] | "RUNNING" | `job_resources.allocated_nodes[].nodename` |
| 23.11 | v0.0.40 | `meta.plugin.data_parser` | ["IDLE", "DRAIN"] | ["RUNNING"] | `job_resources.allocated_nodes[].nodename` |
| 24.05 … 26.11 | v0.0.41 … v0.0.46 | `meta.plugin.data_parser` | ["IDLE", "DRAIN"] | ["RUNNING"] | `job_resources.nodes.allocation[].name` |

Fail closed: a document of another (or no) generation, a node whose state, name or reason is not in the
shape its generation has, a state word Slurm's own parsers never write, a running job whose nodes cannot be
read: all raise UnreadableSlurmDataError naming the node or job and the field. Nothing unreadable is ever
taken for idle, free or in service.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from medic.hostlist import expand_hostlist
from medic.integrations.slurm.errors import UnreadableSlurmDataError, UnsupportedSlurmFormatError
from medic.protocols import JobInfo, JobState, NodeInfo, NodeState

# Drains we make carry this prefix (see NodeInfo.drained_by_medic); anything else belongs to others.
MEDIC_PREFIX = "medic:"

# A gres entry: "gpu:8", "gpu:a100:8", "gpu:a100:8(S:0-1)".
_GPU_GRES = re.compile(r"^gpu(?::[^:(]+)?:(\d+)")
_GPU_MODEL = re.compile(r"^gpu:([^:(]+):\d+")
# "owner=alice" anywhere in a job comment, separated by spaces, commas or semicolons.
_OWNER = re.compile(r"(?:^|[\s,;])owner=([^\s,;]+)")
# "data_parser/v0.0.42", "openapi/v0.0.38", "v0.0.42"
_GENERATION = re.compile(r"(?:^|/)v0\.0\.(\d+)$")

# The generations this module reads (data_parser v0.0.N → N), and the Slurm release that writes each.
GENERATIONS: dict[int, str] = {
    38: "22.05",
    39: "23.02",
    40: "23.11",
    41: "24.05",
    42: "24.11",
    43: "25.05",
    44: "25.11",
    45: "26.05",
    46: "26.11",
}
# Used only when a document names no parser at all: the generation a Slurm release writes by default.
_RELEASE_GENERATION = {(int(r[:2]), int(r[3:])): g for g, r in GENERATIONS.items()}

# Every word Slurm's node-state parsers write (v0.0.38 lower-cases the base state, v0.0.39+ upper-case).
_NODE_BASES = frozenset({"INVALID", "UNKNOWN", "DOWN", "IDLE", "ALLOCATED", "ERROR", "MIXED", "FUTURE"})
_NODE_FLAGS = frozenset(
    {
        "EXTERNAL", "PERFCTRS", "RESERVED", "UNDRAIN", "CLOUD", "RESUME", "DRAIN", "COMPLETING",
        "NOT_RESPONDING", "POWERED_DOWN", "FAIL", "POWERING_UP", "MAINTENANCE", "REBOOT_REQUESTED",
        "REBOOT_CANCELED", "POWERING_DOWN", "DYNAMIC_FUTURE", "REBOOT_ISSUED", "PLANNED", "INVALID_REG",
        "POWER_DOWN", "POWER_UP", "POWER_DRAIN", "POWER_DOWN_ASAP", "POWER_DOWN_FORCE", "DYNAMIC_NORM",
        "BLOCKED",
    }
)  # fmt: skip

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
_JOB_BASES = frozenset(
    {
        "PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
        "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "LAUNCH_FAILED",
    }
)  # fmt: skip
# In a v0.0.40+ state list, the flag that names the job's state, first match wins: flags under which it
# still holds its nodes come before those under which it waits in the queue (Slurm's job_state_string).
_JOB_FLAG_ORDER = (
    "COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "SIGNALING", "STOPPED",
    "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SPECIAL_EXIT", "REVOKED",
)  # fmt: skip
# Flags that leave the base state in charge.
_JOB_QUIET_FLAGS = frozenset({"UPDATE_DB", "RECONFIG_FAIL", "POWER_UP_NODE", "EXPEDITING"})
_JOB_WORDS = _JOB_BASES | set(_JOB_FLAG_ORDER) | _JOB_QUIET_FLAGS


def is_ours(reason: str | None) -> bool:
    return (reason or "").startswith(MEDIC_PREFIX)


def generation(doc: Any, what: str = "document") -> int:
    """The data_parser generation (38 for v0.0.38 …) a `--json` document says it was written in."""
    meta = doc.get("meta") if isinstance(doc, dict) else None
    if not isinstance(meta, dict):
        raise UnsupportedSlurmFormatError(what, "meta", "is missing: no way to tell its format generation")
    named = [
        ("meta.plugin.data_parser", (meta.get("plugin") or {}).get("data_parser")),  # 23.11+
        ("meta.plugins.data_parser", (meta.get("plugins") or {}).get("data_parser")),  # 23.02
        ("meta.plugin.type", (meta.get("plugin") or {}).get("type")),  # 22.05: "openapi/v0.0.38"
    ]
    for field, value in named:
        if isinstance(value, str) and value:
            match = _GENERATION.search(value.split("+")[0])  # "data_parser/v0.0.42+complex"
            if match and int(match.group(1)) in GENERATIONS:
                return int(match.group(1))
            if field != "meta.plugin.type" or match:
                raise UnsupportedSlurmFormatError(
                    what, field, f"is {value!r}, a generation GPU Medic cannot read ({_supported()})"
                )
    release = _release(meta)
    if release in _RELEASE_GENERATION:
        return _RELEASE_GENERATION[release]
    raise UnsupportedSlurmFormatError(
        what,
        "meta",
        f"names no data_parser and a Slurm release {release or 'not given'} GPU Medic cannot read ({_supported()})",
    )


def _supported() -> str:
    return f"it reads v0.0.{min(GENERATIONS)} to v0.0.{max(GENERATIONS)}"


def _release(meta: dict[str, Any]) -> tuple[int, int] | None:
    slurm = meta.get("Slurm") or meta.get("slurm") or {}
    version = slurm.get("version") if isinstance(slurm, dict) else None
    if version is None:
        return None
    try:
        return (int(version["major"]), int(version["minor"]))  # ints until 23.02, strings after
    except (TypeError, KeyError, ValueError):
        return None


def _records(doc: dict[str, Any], key: str, what: str) -> list[dict[str, Any]]:
    records = doc.get(key)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise UnreadableSlurmDataError(what, key, f"is not a list of records (top-level keys: {sorted(doc)})")
    return records


def parse_nodes(doc: Any) -> list[SlurmNode]:
    """The nodes of a `sinfo --json` (22.05) or `scontrol show nodes --json` (23.02+) document."""
    gen = generation(doc, "node list")
    return [SlurmNode.from_json(raw, gen) for raw in _records(doc, "nodes", "node list")]


def parse_jobs(doc: Any) -> list[SlurmJob]:
    """The jobs of a `squeue --json` document."""
    gen = generation(doc, "job list")
    return [SlurmJob.from_json(raw, gen) for raw in _records(doc, "jobs", "job list")]


def _words(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value.upper()]
    if isinstance(value, list) and all(isinstance(w, str) for w in value):
        return [w.upper() for w in value]
    return None


def _optional_string(raw: dict[str, Any], key: str, subject: str) -> str:
    value = raw.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UnreadableSlurmDataError(subject, key, f"is {value!r}, not a string")
    return value


@dataclass(frozen=True, slots=True)
class SlurmNode:
    name: str
    base: str  # idle, allocated, mixed, down, error, future, unknown
    flags: frozenset[str]  # DRAIN, FAIL, REBOOT_REQUESTED, REBOOT_ISSUED, NOT_RESPONDING, ...
    reason: str | None  # as set, without the " [user@time]" that scontrol shows
    gpus: int
    # For the policy's node groups; None where the record does not say (trimmed fields, another shape).
    partitions: tuple[str, ...] | None = None
    features: tuple[str, ...] | None = None
    gpu_model: str | None = None

    @classmethod
    def from_json(cls, raw: dict[str, Any], gen: int = 38) -> SlurmNode:
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise UnreadableSlurmDataError(
                "node", "name", f"is {name!r} in a record with keys {sorted(raw)[:8]}"
            )
        subject = f"node {name}"
        if "state" not in raw:
            raise UnreadableSlurmDataError(subject, "state", "is missing")
        if gen == 38:
            # "idle" plus a separate flag list; a list here is a later generation's shape.
            state, flags = raw["state"], raw.get("state_flags")  # a missing list could hide a DRAIN
            words = _words(flags) if isinstance(state, str) and isinstance(flags, list) else None
            if words is None:
                raise UnreadableSlurmDataError(
                    subject,
                    "state",
                    f"is {state!r} with state_flags {flags!r}, not v0.0.38's string and list",
                )
            words = [state.upper(), *words]
        else:
            state = raw["state"]
            words = _words(state) if isinstance(state, list) else None
            if words is None:
                raise UnreadableSlurmDataError(
                    subject, "state", f"is {state!r}, not the list of state words v0.0.{gen} writes"
                )
        unknown = [w for w in words if w not in _NODE_BASES | _NODE_FLAGS]
        bases = [w for w in words if w in _NODE_BASES]
        if unknown:
            raise UnreadableSlurmDataError(
                subject, "state", f"{words} has words Slurm does not define: {unknown}"
            )
        if len(bases) != 1:
            raise UnreadableSlurmDataError(subject, "state", f"{words} has {len(bases)} base states, not one")
        return cls(
            name=name,
            base=bases[0].lower(),
            flags=frozenset(w for w in words if w not in _NODE_BASES),
            reason=_optional_string(raw, "reason", subject) or None,
            gpus=gpu_count(_optional_string(raw, "gres", subject)),
            partitions=_names(raw.get("partitions")),
            # What a job's --constraint matches: the active features, where Slurm tells them apart.
            features=_names(raw.get("active_features", raw.get("features"))),
            gpu_model=gpu_model(_optional_string(raw, "gres", subject)),
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
        return NodeInfo(
            name=self.name,
            state=self.state,
            reason=self.reason,
            gpus=self.gpus,
            partitions=self.partitions,
            features=self.features,
            gpu_model=self.gpu_model,
        )


def _names(value: Any) -> tuple[str, ...] | None:
    """A comma-separated string (22.05) or a list of strings (23.02 on) as names; None for anything
    else: a node group that needs the list then cannot be decided, rather than taken for empty."""
    if isinstance(value, str):
        return tuple(n.strip() for n in value.split(",") if n.strip())
    if isinstance(value, list) and all(isinstance(n, str) for n in value):
        return tuple(value)
    return None


def gpu_model(gres: str) -> str | None:
    """The GPUs' type as gres names it (`gpu:h100:8` → h100); None when it names none, or several."""
    models = {m.group(1) for entry in gres.split(",") if (m := _GPU_MODEL.match(entry.strip()))}
    return models.pop() if len(models) == 1 else None


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
    state: str  # squeue's job_state as one word, e.g. RUNNING, PENDING, COMPLETING
    user: str
    comment: str
    nodes: tuple[str, ...]  # the nodes it holds (or last held); empty while pending
    restarts: int
    excluded: str  # its ExcNodeList as a Slurm hostlist expression, "" for none
    reason: str = ""  # why a pending job waits (squeue's state_reason: Resources, BeginTime, ...); "" unknown

    @classmethod
    def from_json(cls, raw: dict[str, Any], gen: int = 38) -> SlurmJob:
        job_id = raw.get("job_id")
        if isinstance(job_id, bool) or not isinstance(job_id, int | str) or str(job_id) == "":
            raise UnreadableSlurmDataError(
                "job", "job_id", f"is {job_id!r} in a record with keys {sorted(raw)[:8]}"
            )
        subject = f"job {job_id}"
        state = _job_state(raw.get("job_state"), gen, subject)
        nodes = _job_nodes(raw, gen, subject)
        if not nodes and _JOB_STATES.get(state) is JobState.RUNNING:
            raise UnreadableSlurmDataError(
                subject,
                "job_resources",
                f"names no nodes although the job is {state}: its nodes would look free",
            )
        user = raw.get("user_name") or raw.get("user_id", "")
        restarts = raw.get("restart_cnt") or 0
        if isinstance(restarts, dict):  # {"set": true, "infinite": false, "number": 2}
            restarts = restarts.get("number") or 0
        if not isinstance(restarts, int):
            raise UnreadableSlurmDataError(subject, "restart_cnt", f"is {restarts!r}, not a number")
        return cls(
            id=str(job_id),
            state=state,
            user=str(user),
            comment=_optional_string(raw, "comment", subject),
            nodes=nodes,
            restarts=restarts,
            excluded=_optional_string(raw, "excluded_nodes", subject),
            reason=_optional_string(raw, "state_reason", subject),
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


def _job_state(value: Any, gen: int, subject: str) -> str:
    """One word for the job's state: a string up to v0.0.39, a base state plus flags after."""
    if gen <= 39:
        words = _words(value) if isinstance(value, str) else None
        shape = "a string"
    else:
        words = _words(value) if isinstance(value, list) else None
        shape = "a list of state words"
    if not words:
        raise UnreadableSlurmDataError(
            subject, "job_state", f"is {value!r}, not {shape} as v0.0.{gen} writes"
        )
    unknown = [w for w in words if w not in _JOB_WORDS]
    if unknown:
        raise UnreadableSlurmDataError(
            subject, "job_state", f"{words} has words Slurm does not define: {unknown}"
        )
    if gen <= 39:
        return words[0]
    for flag in _JOB_FLAG_ORDER:
        if flag in words:
            return flag
    bases = [w for w in words if w in _JOB_BASES]
    if len(bases) != 1:
        raise UnreadableSlurmDataError(subject, "job_state", f"{words} has {len(bases)} base states, not one")
    return bases[0]


def _job_nodes(raw: dict[str, Any], gen: int, subject: str) -> tuple[str, ...]:
    """The nodes the job holds: per-node records where Slurm gives them, else its node hostlist."""
    resources = raw.get("job_resources")
    if resources is None or resources == {}:
        return ()  # pending: nothing allocated yet
    if not isinstance(resources, dict):
        raise UnreadableSlurmDataError(subject, "job_resources", f"is {resources!r}, not an object")
    try:
        if gen <= 40:
            field = "job_resources.allocated_nodes[].nodename"
            names = tuple(n["nodename"] for n in resources.get("allocated_nodes") or ())
            listed = resources.get("nodes")
        else:
            field = "job_resources.nodes.allocation[].name"
            nodes = resources["nodes"]
            names = tuple(n["name"] for n in nodes.get("allocation") or ())
            listed = nodes.get("list")
        if not all(isinstance(n, str) and n for n in names):
            raise TypeError(names)
        if names:
            return names
        # 22.05-23.11 leave the per-node list empty when slurmctld sent no core layout: then the
        # hostlist of job_resources, else the job's own `nodes`.
        field = "job_resources node list"
        if listed in (None, ""):
            field, listed = "nodes", raw.get("nodes")
        if listed in (None, ""):
            return ()
        if not isinstance(listed, str):
            raise TypeError(listed)
        return expand_hostlist(listed)
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise UnreadableSlurmDataError(
            subject, field, f"cannot be read from {str(resources)[:200]} ({type(error).__name__}: {error})"
        ) from error


def boot_time(raw: dict[str, Any], name: str) -> int | None:
    """`boot_time` of a node record, epoch seconds; None before slurmd ever registered."""
    value = raw.get("boot_time")
    try:
        return epoch(value)
    except ValueError:
        raise UnreadableSlurmDataError(
            f"node {name}", "boot_time", f"is {value!r}: no way to prove a reboot happened"
        ) from None


def epoch(value: Any) -> int | None:
    """A time Slurm writes in epoch seconds (`boot_time`, `reason_changed_at`): an integer in v0.0.38,
    {"set", "infinite", "number"} from v0.0.39. None when unset, infinite or 0 (never happened);
    ValueError for any other shape."""
    number = value
    if isinstance(value, dict):
        if value.get("set") is False or value.get("infinite") is True:
            return None
        number = value.get("number")
    if isinstance(number, bool) or not isinstance(number, int):
        raise ValueError(f"{value!r} is not epoch seconds")
    return number or None
