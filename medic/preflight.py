"""The Slurm prolog's preflight, judged: what NVML answered about a node's GPUs, and how its time
budget went, become failures, each with our reason (docs/agent.md, "The prolog's preflight").

Pure: the hook (medic/apps/prolog.py) reads NVML, runs DCGM and turns what it got into these types;
this module decides. Every NVML answer is one of three things:

- a value, judged;
- not supported: the GPU has no such thing (Hopper has no page retirement, a GPU before Ampere no
  row remapping). Never a failure, but said, as the agent does;
- unreadable: NVML failed to answer, or gave nothing. A failure: a check that cannot read its
  field cannot pass.

The XID-class conditions are read from the state they leave behind, which NVML keeps until a
reset: a double-bit error (XID 48) as the volatile uncorrected ECC count, a row remap (XIDs
63/64) as a pending or failed remap, a page retirement as pending, a GPU off the bus (XID 79) as
lost. Past XID events are not: an NVML event set sees nothing from before it was created.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from medic.events import EventKind

REASON_PREFIX = "medic: preflight"
# Slurm keeps a long reason, but `sinfo` and people read the start: the first failure, cut here.
MAX_REASON_CHARS = 200

# The time the prolog may hold a job's start. NVIDIA: DCGM level 1 is "quick deployment checks,
# normally lasting seconds", and the quick checks take milliseconds; 30 s leaves level 1 25 s (5 s
# are kept to stop a dcgmi that hangs), yet keeps a stuck node from holding a many-node job for
# minutes: the slowest node's prolog is every node's wait.
DEFAULT_BUDGET_S = 30.0

# The checks, in the order a drain reason names them: the node as a whole first, then what most
# certainly needs a repair.
CHECKS = (
    "nvml",
    "gpu_count",
    "gpu_lost",
    "row_remap",
    "retired_pages",
    "ecc",
    "clocks",
    "persistence_mode",
    "budget",
    "dcgm_l1",
)

# NVML's fields, named as medic/integrations/nvml.py names them in its errors and unsupported lists.
ECC_FIELD = "ecc volatile uncorrected"
RETIRED_FIELD = "retired pages pending"
REMAP_FIELD = "remapped rows"
CLOCKS_FIELD = "clock event reasons"
PERSISTENCE_FIELD = "persistence mode"

# Clock event reasons that slow a GPU for its hardware's sake (a power brake, an over-temperature
# signal). On an idle GPU no load explains them. A software power cap, application clocks or sync
# boost are settings, not faults.
SLOWDOWN_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")


@dataclass(frozen=True, slots=True)
class GpuAnswers:
    """What NVML answered for one GPU. None: no value (see `unsupported` and `errors` for why)."""

    index: int
    lost: str | None = None  # why the GPU does not answer at all, in NVML's words
    ecc_volatile_uncorrected: int | None = None
    retired_pages_pending: bool | None = None
    row_remap: tuple[bool, bool] | None = None  # (pending, failure)
    clock_reasons: tuple[str, ...] | None = None
    persistence_mode: bool | None = None
    unsupported: frozenset[str] = frozenset()  # fields the GPU answered NotSupported
    errors: Mapping[str, str] = field(default_factory=dict)  # field -> NVML's error


@dataclass(frozen=True, slots=True)
class NodeAnswers:
    gpu_count: int  # GPUs NVML enumerates, lost ones included
    gpus: tuple[GpuAnswers, ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed check. `kind` and `facts`: the event the agent would send for the same finding,
    so GPU Medic's policy decides on a preflight failure as on the agent's report."""

    check: str
    detail: str
    gpu: int | None = None
    kind: EventKind | None = None
    facts: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.check}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Verdict:
    failures: tuple[Failure, ...] = ()
    unsupported: tuple[str, ...] = ()  # "GPU 0: retired pages pending not supported"

    @property
    def passed(self) -> bool:
        return not self.failures


# -- the quick checks -------------------------------------------------------------------------


def judge_unavailable(reason: str, expected_gpus: int | None) -> Verdict:
    """NVML did not answer at all. Only a node that should have no GPUs passes."""
    if expected_gpus == 0:
        return Verdict(unsupported=(f"no NVML ({reason}); no GPUs expected",))
    return Verdict((Failure("nvml", reason),))


def judge(node: NodeAnswers, expected_gpus: int | None) -> Verdict:
    """The quick checks on one NVML read. `expected_gpus` None: the count is not checked."""
    failures = list(_count(node, expected_gpus))
    unsupported: list[str] = []
    for gpu in node.gpus:
        if gpu.lost is not None:
            failures.append(
                _missing(node, expected_gpus, "gpu_lost", f"GPU {gpu.index}: {gpu.lost}", gpu.index)
            )
            continue
        for check in _GPU_CHECKS:
            found = check.judge(gpu)
            if isinstance(found, Failure):
                failures.append(found)
            elif found:
                unsupported.append(found)
    return Verdict(tuple(failures), tuple(unsupported))


def _count(node: NodeAnswers, expected: int | None) -> Iterable[Failure]:
    if expected is None or node.gpu_count == expected:
        return ()
    detail = f"{node.gpu_count} GPUs visible, {expected} expected"
    if node.gpu_count > expected:  # a setting to fix, not a GPU to repair
        return (Failure("gpu_count", detail),)
    return (_missing(node, expected, "gpu_count", detail, None),)


def _missing(node: NodeAnswers, expected: int | None, check: str, detail: str, gpu: int | None) -> Failure:
    """A GPU that does not answer, as the agent reports it (`gpu_missing`); every such failure of
    one node carries the same facts, so they make one event."""
    lost = [g.index for g in node.gpus if g.lost is not None]
    should = max(node.gpu_count, expected or 0)
    facts = {"expected": should, "found": node.gpu_count - len(lost), "lost_gpus": lost}
    return Failure(check, detail, gpu, EventKind.GPU_MISSING, facts)


@dataclass(frozen=True, slots=True)
class _GpuCheck:
    name: str
    field: str
    value: Callable[[GpuAnswers], Any]
    problem: Callable[[Any], str | None]
    kind: EventKind | None = None
    facts: Callable[[Any], Mapping[str, Any]] = lambda _: {}

    def judge(self, gpu: GpuAnswers) -> Failure | str | None:
        """A failure, a note that the field is not supported, or None: it passed."""
        value = self.value(gpu)
        if value is None:
            if self.field in gpu.unsupported:
                return f"GPU {gpu.index}: {self.field} not supported"
            why = gpu.errors.get(self.field, "no answer")
            return Failure(self.name, f"GPU {gpu.index}: {self.field} unreadable ({why})", gpu.index)
        problem = self.problem(value)
        if problem is None:
            return None
        return Failure(self.name, f"GPU {gpu.index}: {problem}", gpu.index, self.kind, self.facts(value))


def _remap_problem(remap: tuple[bool, bool]) -> str | None:
    pending, failure = remap
    if failure:
        return "row remapping failed: no spare row was left for a failing one"
    return "row remap pending: the GPU must be reset before the row is replaced" if pending else None


def _slowdown(reasons: tuple[str, ...]) -> str | None:
    # Judged on an idle GPU only: one another job keeps busy on a shared node may be slowed by its
    # load, and that job's, not this prolog's (the agent reports its heat).
    slowed = [r for r in reasons if r in SLOWDOWN_REASONS]
    return f"clocks slowed while idle: {', '.join(slowed)}" if slowed and "gpu_idle" in reasons else None


_GPU_CHECKS = (
    _GpuCheck(
        "row_remap",
        REMAP_FIELD,
        lambda g: g.row_remap,
        _remap_problem,
        EventKind.ECC,
        lambda r: {"row_remap_pending": r[0], "row_remap_failure": r[1]},
    ),
    _GpuCheck(
        "retired_pages",
        RETIRED_FIELD,
        lambda g: g.retired_pages_pending,
        lambda pending: "page retirement pending: the GPU must be reset to retire them" if pending else None,
        EventKind.ECC,
        lambda pending: {"retired_pages_pending": pending},
    ),
    _GpuCheck(
        "ecc",
        ECC_FIELD,
        lambda g: g.ecc_volatile_uncorrected,
        lambda n: f"{n} uncorrectable ECC errors since the driver loaded" if n else None,
        EventKind.ECC,
        lambda n: {"dbe": n, "counter": "volatile"},
    ),
    _GpuCheck("clocks", CLOCKS_FIELD, lambda g: g.clock_reasons, _slowdown),
    _GpuCheck(
        "persistence_mode",
        PERSISTENCE_FIELD,
        lambda g: g.persistence_mode,
        lambda on: None if on else "persistence mode is off",
    ),
)


# -- the budget ---------------------------------------------------------------------------------


def dcgm_timeout(budget_s: float, elapsed_s: float, stop_s: float) -> float:
    """What DCGM level 1 may take of the budget: what is left, less the `stop_s` a dcgmi that does
    not finish takes to be stopped. Zero or less: no time left to start it."""
    return budget_s - elapsed_s - stop_s


def overrun(what: str, seconds: float, budget_s: float) -> Failure:
    return Failure("budget", f"{what} did not finish within {seconds:.1f} s of the {budget_s:g} s budget")


def no_time_for(what: str, elapsed_s: float, budget_s: float) -> Failure:
    return Failure(
        "budget", f"{elapsed_s:.1f} s of the {budget_s:g} s budget spent before {what} could start"
    )


# -- what the prolog reports --------------------------------------------------------------------


def ordered(failures: Iterable[Failure]) -> list[Failure]:
    return sorted(failures, key=lambda f: (CHECKS.index(f.check), -1 if f.gpu is None else f.gpu))


def drain_reason(failures: Iterable[Failure]) -> str:
    """`medic: preflight <check>: <detail>` for the first failure, and how many more there are."""
    first, *rest = ordered(failures)
    more = f" (+{len(rest)} more)" if rest else ""
    reason = f"{REASON_PREFIX} {first.describe()}"
    room = MAX_REASON_CHARS - len(more)
    return (reason if len(reason) <= room else reason[: room - 3] + "...") + more


def summary(failures: Iterable[Failure]) -> dict[str, Any]:
    """The attributes of the prolog's `health_check` event (`check: preflight`): every failure."""
    found = ordered(failures)
    return {
        "check": "preflight",
        "result": "fail",
        "message": "; ".join(f.describe() for f in found),
        "failed": [{"check": f.check, "gpu": f.gpu, "detail": f.detail} for f in found],
    }


def agent_events(failures: Iterable[Failure]) -> list[tuple[EventKind, int | None, dict[str, Any]]]:
    """(kind, gpu, attributes) of the events the agent would send for these findings: one per kind
    and GPU (a GPU's pending remap and its ECC count are one `ecc` event, as the agent sends them)."""
    merged: dict[tuple[EventKind, int | None], dict[str, Any]] = {}
    for failure in ordered(failures):
        if failure.kind is not None:
            # One `gpu_missing` per node, as the agent sends it, however many GPUs are gone.
            gpu = None if failure.kind is EventKind.GPU_MISSING else failure.gpu
            merged.setdefault((failure.kind, gpu), {}).update(failure.facts)
    return [(kind, gpu, facts) for (kind, gpu), facts in merged.items()]
