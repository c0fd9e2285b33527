"""Deep health checks: what a node shows, judged against the shape the policy expects (pure).

Each check gives a verdict with its reason: `pass`, `fail` (the node is not what its shape says),
`error` (nothing could be measured, so nothing is known: never a pass) or `skipped` (not run, because
an earlier check already kept the node out, or the tool it needs is not on the node: never a pass
either). docs/deep-checks.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from medic.policy.deep_checks import CHECK_ORDER, CheckName, DeepChecks, Shape
from medic.policy.model import Action
from medic.protocols import (
    AllReduceRun,
    DiagnosticResult,
    InstanceReading,
    JobInfo,
    JobState,
    NicLatencyRun,
    NicLoopbackRun,
    NodeInfo,
)


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    SKIPPED = "skipped"


class CheckResult(BaseModel):
    """One check's verdict on one node (the all-reduce: on the nodes it ran across)."""

    model_config = ConfigDict(frozen=True)

    check: CheckName
    nodes: list[str]
    verdict: Verdict
    reason: str
    shape: str | None = None
    measured: dict[str, Any] = Field(default_factory=dict)
    command: list[str] = Field(default_factory=list)
    output: str = ""  # what the tool printed: kept as the incident's evidence

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.PASS

    def line(self) -> str:
        return f"{self.check.value} on {', '.join(self.nodes)} {self.verdict.value}: {self.reason}"


def size_text(n: int) -> str:
    """8589934592 → 8 GiB, 1048576 → 1 MiB, 1000 → 1000 B: the sizes nccl-tests is given."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def no_shape(check: CheckName, node: str) -> CheckResult:
    return CheckResult(
        check=check,
        nodes=[node],
        verdict=Verdict.ERROR,
        reason=f"{node} has no shape: no pattern of the policy's deep_checks.nodes matches it",
    )


def skipped(check: CheckName, nodes: Sequence[str], why: str) -> CheckResult:
    return CheckResult(check=check, nodes=list(nodes), verdict=Verdict.SKIPPED, reason=why)


def not_run(check: CheckName, nodes: Sequence[str], why: str) -> CheckResult:
    """A check that could not run: no verdict about the node, so never a pass."""
    return CheckResult(check=check, nodes=list(nodes), verdict=Verdict.ERROR, reason=why)


def _unread(check: CheckName, reading: InstanceReading, shape_name: str) -> CheckResult:
    return CheckResult(
        check=check,
        nodes=[reading.node],
        verdict=Verdict.ERROR,
        reason=f"the GPUs of {reading.node} could not be read: {reading.error}",
        shape=shape_name,
        output=reading.output,
    )


def judge_gpu_count(reading: InstanceReading, shape_name: str, shape: Shape) -> CheckResult:
    """Every GPU of the shape is enumerated by the driver and answers."""
    if reading.error is not None or reading.gpu_count is None:
        return _unread(CheckName.GPU_COUNT, reading, shape_name)
    lost = [g.index for g in reading.gpus if g.lost]
    answering = len(reading.gpus) - len(lost)
    problems = []
    if reading.gpu_count != shape.gpus:
        problems.append(
            f"the driver enumerates {reading.gpu_count} GPUs, shape {shape_name} has {shape.gpus}"
        )
    if lost:
        problems.append(f"GPU {', '.join(map(str, lost))} {'does' if len(lost) == 1 else 'do'} not answer")
    return CheckResult(
        check=CheckName.GPU_COUNT,
        nodes=[reading.node],
        verdict=Verdict.FAIL if problems else Verdict.PASS,
        reason="; ".join(problems) or f"{answering} of {shape.gpus} GPUs answer",
        shape=shape_name,
        measured={
            "expected": shape.gpus,
            "enumerated": reading.gpu_count,
            "answering": answering,
            "lost": lost,
        },
        output=reading.output,
    )


def judge_nvlink(reading: InstanceReading, shape_name: str, shape: Shape) -> CheckResult:
    """Every GPU that answers has the shape's NVLink links up. A lost GPU reports none."""
    if reading.error is not None or reading.gpu_count is None:
        return _unread(CheckName.NVLINK, reading, shape_name)
    expected = shape.nvlinks_per_gpu
    up = {g.index: len(g.links_up) for g in reading.gpus}
    down = {g.index: list(g.links_down) for g in reading.gpus if g.links_down}
    measured = {"expected_per_gpu": expected, "links_up": up, "links_down": down}
    if expected == 0:
        reason = f"shape {shape_name} has no NVLink to check"
        return CheckResult(
            check=CheckName.NVLINK,
            nodes=[reading.node],
            verdict=Verdict.PASS,
            reason=reason,
            shape=shape_name,
            measured=measured,
            output=reading.output,
        )
    short = []
    for gpu in reading.gpus:
        if gpu.lost:
            short.append(f"GPU {gpu.index}: lost, no link read")
        elif len(gpu.links_up) < expected:
            where = f" (down: {', '.join(map(str, gpu.links_down))})" if gpu.links_down else ""
            short.append(f"GPU {gpu.index}: {len(gpu.links_up)} of {expected} links up{where}")
    if not reading.gpus:
        short.append("no GPU to read links from")
    return CheckResult(
        check=CheckName.NVLINK,
        nodes=[reading.node],
        verdict=Verdict.FAIL if short else Verdict.PASS,
        reason="; ".join(short) or f"{expected} links up on each of {len(reading.gpus)} GPUs",
        shape=shape_name,
        measured=measured,
        output=reading.output,
    )


def judge_dcgm(result: DiagnosticResult) -> CheckResult:
    """DCGM's own verdict: an `error` (it did not run, or not completely) is no pass."""
    verdict = {"pass": Verdict.PASS, "fail": Verdict.FAIL}.get(result.result, Verdict.ERROR)
    return CheckResult(
        check=CheckName.DCGM,
        nodes=[result.node],
        verdict=verdict,
        reason=result.detail or f"DCGM level {result.level} {result.result}",
        measured={"level": result.level, "result": result.result, "error_ids": list(result.error_ids)},
    )


def judge_nic_loopback(
    node: str,
    runs: Sequence[NicLoopbackRun],
    shape_name: str,
    shape: Shape,
    latencies: Sequence[NicLatencyRun] = (),
) -> CheckResult:
    """ib_write_bw, then ib_write_lat, in loopback on every RDMA device of the shape: each bandwidth no
    lower than the shape's floor, each typical latency no higher than its ceiling (either absent: reported,
    not judged). No latency measured at all passes only a shape without a ceiling."""
    floor, ceiling = shape.nic_bw_floor_gbps, shape.nic_lat_ceiling_us
    base = {
        "check": CheckName.NIC_LOOPBACK,
        "nodes": [node],
        "shape": shape_name,
        "command": [word for run in runs[:1] for word in run.command],  # the others differ only in -d
        "output": "\n".join(
            [f"== {run.device} ==\n{run.output}" for run in runs]
            + [f"== {lat.device} latency ==\n{lat.output}" for lat in latencies]
        ),
    }
    if not shape.rdma_devices:
        return CheckResult(
            **base, verdict=Verdict.PASS, reason=f"shape {shape_name} has no RDMA device to check"
        )
    tools = [run.missing_tool for run in runs] + [lat.missing_tool for lat in latencies]
    missing = sorted({tool for tool in tools if tool})
    if missing:
        return CheckResult(
            **base, verdict=Verdict.SKIPPED, reason=f"not run: {', '.join(missing)} not installed on {node}"
        )
    measured = {
        "floor_gbps": floor,
        "bw_avg_gbps": {run.device: run.bw_avg_gbps for run in runs},
        "bw_peak_gbps": {run.device: run.bw_peak_gbps for run in runs},
        "size_bytes": {run.device: run.size_bytes for run in runs},
        "ceiling_us": ceiling,
        "lat_typical_us": {lat.device: lat.typical_us for lat in latencies},
        "lat_p99_us": {lat.device: lat.p99_us for lat in latencies},
        "lat_p999_us": {lat.device: lat.p999_us for lat in latencies},
    }
    errors = [f"{run.device}: {run.error or 'no bandwidth read'}" for run in runs if run.bw_avg_gbps is None]
    errors += [f"{d}: not measured" for d in shape.rdma_devices if d not in {run.device for run in runs}]
    errors += [
        f"{lat.device} latency: {lat.error or 'no latency read'}"
        for lat in latencies
        if lat.typical_us is None
    ]
    if latencies:
        timed = {lat.device for lat in latencies}
        errors += [f"{d} latency: not measured" for d in shape.rdma_devices if d not in timed]
    elif ceiling is not None:
        errors.append(f"latency not measured on {node}")
    if errors:
        return CheckResult(**base, verdict=Verdict.ERROR, reason="; ".join(errors), measured=measured)
    problems = []
    below = [f"{run.device} {run.bw_avg_gbps:g} Gb/s" for run in runs if _under(run.bw_avg_gbps, floor)]
    if below:
        problems.append(f"{', '.join(below)}, under the floor of {floor:g} Gb/s of shape {shape_name}")
    above = [f"{lat.device} {lat.typical_us:g} µs" for lat in latencies if _under(ceiling, lat.typical_us)]
    if above:
        problems.append(
            f"{', '.join(above)} typical latency, over the ceiling of {ceiling:g} µs of shape {shape_name}"
        )
    if problems:
        return CheckResult(**base, verdict=Verdict.FAIL, reason="; ".join(problems), measured=measured)
    judged = f"floor {floor:g} Gb/s" if floor is not None else f"no floor in shape {shape_name}"
    seen = [", ".join(f"{run.device} {run.bw_avg_gbps:g} Gb/s" for run in runs), judged]
    if latencies:
        seen.append(
            ", ".join(f"{lat.device} {lat.typical_us:g} µs" for lat in latencies) + " typical latency"
        )
        seen.append(f"ceiling {ceiling:g} µs" if ceiling is not None else f"no ceiling in shape {shape_name}")
    return CheckResult(**base, verdict=Verdict.PASS, reason="; ".join(seen), measured=measured)


def _under(value: float | None, limit: float | None) -> bool:
    """value < limit where both are known: a bound that is absent judges nothing."""
    return value is not None and limit is not None and value < limit


def _short(host: str) -> str:
    return host.split(".")[0]


def judge_all_reduce(run: AllReduceRun, shape_name: str, shape: Shape) -> CheckResult:
    """Right results on every rank of every node asked for, at no less than the shape's floor."""
    spec = run.spec
    floor = shape.floor(len(spec.nodes))
    base = {
        "check": CheckName.ALL_REDUCE,
        "nodes": list(spec.nodes),
        "shape": shape_name,
        "command": list(run.command),
        "output": run.output,
    }
    if run.error is not None:
        return CheckResult(**base, verdict=Verdict.ERROR, reason=run.error)
    problems = []
    expected_ranks = len(spec.nodes) * spec.gpus_per_node
    if run.ranks != expected_ranks:
        problems.append(f"ran on {run.ranks} ranks, {expected_ranks} expected")
    strangers = sorted({_short(h) for h in run.hosts} - {_short(n) for n in spec.nodes})
    missing = sorted({_short(n) for n in spec.nodes} - {_short(h) for h in run.hosts})
    if strangers or missing:
        problems.append(f"ran on {', '.join(sorted(run.hosts)) or 'no host'}, not on {', '.join(spec.nodes)}")
    if run.out_of_bounds:
        problems.append(f"wrong results: {run.out_of_bounds} out of bounds values")
    if run.wrong:
        problems.append(f"wrong elements at {'; '.join(run.wrong)}")
    problems += run.failures
    largest = size_text(run.largest_bytes) if run.largest_bytes is not None else "?"
    if run.busbw_gbps is None:
        problems.append("no bus bandwidth at the largest size")
    elif run.busbw_gbps < floor:
        problems.append(
            f"busbw {run.busbw_gbps:g} GB/s at {largest}, under the floor of {floor:g} GB/s of shape {shape_name}"
        )
    measured = {
        "busbw_gbps": run.busbw_gbps,
        "floor_gbps": floor,
        "largest_bytes": run.largest_bytes,
        "avg_busbw_gbps": run.avg_busbw_gbps,
        "ranks": run.ranks,
        "hosts": list(run.hosts),
        "out_of_bounds": run.out_of_bounds,
        "version": run.version,
    }
    reason = "; ".join(problems) or (
        f"busbw {run.busbw_gbps:g} GB/s at {largest} on {run.ranks} ranks, floor {floor:g} GB/s"
    )
    return CheckResult(
        **base, verdict=Verdict.FAIL if problems else Verdict.PASS, reason=reason, measured=measured
    )


def unfit_for_stress(info: NodeInfo, jobs: Iterable[JobInfo]) -> str | None:
    """Why the GPUs of this node must not be loaded now, or None. A DCGM level of 2 or more and the
    all-reduce take every GPU: never beside a job, never where the scheduler may place one."""
    if not info.out_of_service:
        return f"{info.name} is {info.state.value}, in service: drain it first, the check loads every GPU"
    running = sorted(j.id for j in jobs if j.state is JobState.RUNNING)
    if running:
        return f"job {', '.join(running)} still runs on {info.name}"
    return None


def overall(results: Iterable[CheckResult]) -> Verdict:
    """`fail` if any check failed; `pass` only if there were checks and every one passed; else `error`."""
    verdicts = [r.verdict for r in results]
    if Verdict.FAIL in verdicts:
        return Verdict.FAIL
    if verdicts and all(v is Verdict.PASS for v in verdicts):
        return Verdict.PASS
    return Verdict.ERROR


def summary(results: Sequence[CheckResult]) -> str:
    """One line: every check that passed by name, then each one that did not with its reason."""
    passed = [r.check.value for r in results if r.passed]
    others = [r.line() for r in results if not r.passed]
    head = [f"{', '.join(passed)} passed"] if passed else []
    return "; ".join(head + others) or "no check ran"


def verify_checks(deep: DeepChecks, verify_level: int, action: Action) -> tuple[tuple[CheckName, ...], int]:
    """What verification runs after `action` before the node may return: the checks the policy
    requires for the transition, always with DCGM, and the DCGM level (the deep checks' own when
    they require `dcgm`, never below `verify_level`)."""
    required = deep.required(replaced=action is Action.REPLACE)
    level = max(verify_level, deep.dcgm_level) if CheckName.DCGM in required else verify_level
    wanted = {*required, CheckName.DCGM}
    return tuple(c for c in CHECK_ORDER if c in wanted), level
