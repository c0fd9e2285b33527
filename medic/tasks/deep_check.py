"""Deep checks: each check run on its node(s) through its backend, judged by the policy's shapes
(medic/deep_check.py), and what the tool printed kept as the incident's evidence: one step per
check (its verdict, reason, measurements, command and output), the DCGM run also in `diagnostics`.

A check that cannot run says so as an `error` result: a backend that raises, a node with no shape, a
node whose GPUs must not be loaded now; one whose tool is not on the node is `skipped`, never a pass. Once a check on a node did not pass, the later ones on it
(and the all-reduce over it) are skipped: the node stays out whatever they would show.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime

from prefect import task

from medic.deep_check import (
    CheckResult,
    Verdict,
    judge_all_reduce,
    judge_dcgm,
    judge_gpu_count,
    judge_nic_loopback,
    judge_nvlink,
    no_shape,
    not_run,
    skipped,
    unfit_for_stress,
)
from medic.policy.deep_checks import CHECK_ORDER, CheckName, DeepChecks
from medic.protocols import AllReduceSpec, InstanceReading, NicLatencyRun, NicLoopbackRun
from medic.statuses import StepStatus
from medic.store import utcnow
from medic.tasks.diagnose import LEVEL_BUDGET_S
from medic.tasks.nodes.evidence import record_diagnostic
from medic.tasks.runtime.process import Runtime, current
from medic.tasks.runtime.stage import run_logger

PROBE_TIMEOUT_S = 120.0
SLACK_S = 60.0  # a task's budget over what its backends are given: recording, the scheduler's answers
# The evidence kept per check: nccl-tests under NCCL_DEBUG=INFO can print megabytes. Its head holds
# the run's header and ranks, its tail the table, the footer and any failure: both are kept.
KEPT_HEAD = 32 * 1024
KEPT_TAIL = 224 * 1024
STEP_STATUS = {Verdict.PASS: StepStatus.OK, Verdict.SKIPPED: StepStatus.SKIPPED}


def kept(output: str) -> str:
    if len(output) <= KEPT_HEAD + KEPT_TAIL:
        return output
    left_out = len(output) - KEPT_HEAD - KEPT_TAIL
    return f"{output[:KEPT_HEAD]}\n[… {left_out} characters left out …]\n{output[-KEPT_TAIL:]}"


def record_check(rt: Runtime, incident_id: str | None, result: CheckResult, started: datetime) -> None:
    """One step per check on the incident (none without one), and one line in the run's log."""
    if incident_id is not None:
        rt.store.add_step(
            incident_id,
            f"deep check: {result.check.value} {', '.join(result.nodes)}",
            started,
            STEP_STATUS.get(result.verdict, StepStatus.FAILED),
            result.reason,
            result.model_dump(mode="json") | {"output": kept(result.output)},
        )
    run_logger().info("deep check %s", result.line())


def _guard(rt: Runtime, nodes: Sequence[str]) -> str | None:
    """Why the GPUs of one of these nodes must not be loaded now (medic.deep_check.unfit_for_stress)."""
    scheduler = rt.backends.scheduler
    for node in nodes:
        why = unfit_for_stress(scheduler.node(node), scheduler.jobs_on_node(node))
        if why:
            return why
    return None


def _read(rt: Runtime, node: str) -> InstanceReading:
    try:
        return rt.backends.instance.read(node, PROBE_TIMEOUT_S)
    except Exception as error:  # any backend failure is no reading, and so never a pass
        return InstanceReading(node, error=f"{type(error).__name__}: {error}")


def dcgm_check(rt: Runtime, incident_id: str | None, node: str, level: int, note: str) -> CheckResult:
    """DCGM at `level`; its run is kept in the incident's diagnostics like any other."""
    if level >= 2 and (why := _guard(rt, [node])):
        return not_run(CheckName.DCGM, [node], f"DCGM level {level} not run: {why}")
    try:
        result = rt.backends.diagnostics.run(node, level, timeout_s=LEVEL_BUDGET_S[level])
    except Exception as error:
        return not_run(
            CheckName.DCGM, [node], f"DCGM level {level} on {node}: {type(error).__name__}: {error}"
        )
    if incident_id is not None:
        record_diagnostic(rt, incident_id, result, note=note)
    return judge_dcgm(result)


def _loopback(rt: Runtime, deep: DeepChecks, node: str, device: str) -> NicLoopbackRun:
    settings = deep.nic_loopback
    try:
        return rt.backends.nic_loopback.run(
            node, device, settings.size_bytes, settings.duration_seconds, settings.timeout_seconds
        )
    except Exception as error:  # any backend failure is no measurement, and so never a pass
        return NicLoopbackRun(node, device, error=f"{type(error).__name__}: {error}")


def _latency(rt: Runtime, deep: DeepChecks, node: str, device: str) -> NicLatencyRun:
    settings = deep.nic_loopback
    try:
        return rt.backends.nic_loopback.latency(
            node, device, settings.latency_iterations, settings.timeout_seconds
        )
    except Exception as error:  # any backend failure is no measurement, and so never a pass
        return NicLatencyRun(node, device, error=f"{type(error).__name__}: {error}")


def nic_loopback_check(rt: Runtime, node: str) -> CheckResult:
    """ib_write_bw, then ib_write_lat, in loopback on each RDMA device of the node's shape, one run
    after the other: two at once would share the PCIe and memory they measure, and bandwidth traffic
    would queue in front of the latency's."""
    deep = rt.policy().policy.deep_checks
    shaped = deep.shape_of(node)
    if shaped is None:
        return no_shape(CheckName.NIC_LOOPBACK, node)
    devices = shaped[1].rdma_devices
    if devices and (why := _guard(rt, [node])):
        return not_run(CheckName.NIC_LOOPBACK, [node], f"NIC loopback not run: {why}")
    runs = [_loopback(rt, deep, node, device) for device in devices]
    latencies = [_latency(rt, deep, node, device) for device in devices]
    return judge_nic_loopback(node, runs, *shaped, latencies)


def node_checks(
    rt: Runtime, incident_id: str | None, node: str, checks: Collection[CheckName], level: int, note: str
) -> list[CheckResult]:
    """The checks of one node (GPUs, NVLink, DCGM at `level`, its NICs), in the suite's order, each recorded.
    NVML is read once for both the GPU count and the links."""
    shaped = rt.policy().policy.deep_checks.shape_of(node)
    reading: InstanceReading | None = None
    results: list[CheckResult] = []
    for check in CHECK_ORDER:
        if check not in checks or check is CheckName.ALL_REDUCE:
            continue
        started = utcnow()
        failed = next((r for r in results if not r.passed), None)
        if failed:
            result = skipped(check, [node], f"not run: {failed.check.value} {failed.verdict.value} on {node}")
        elif check is CheckName.DCGM:
            result = dcgm_check(rt, incident_id, node, level, note)
        elif check is CheckName.NIC_LOOPBACK:
            result = nic_loopback_check(rt, node)
        elif shaped is None:
            result = no_shape(check, node)
        else:
            reading = reading or _read(rt, node)
            judge = judge_gpu_count if check is CheckName.GPU_COUNT else judge_nvlink
            result = judge(reading, *shaped)
        record_check(rt, incident_id, result, started)
        results.append(result)
    return results


def _all_reduce(rt: Runtime, deep: DeepChecks, nodes: Sequence[str]) -> CheckResult:
    shapes = {node: deep.shape_of(node) for node in nodes}
    unshaped = [n for n, s in shapes.items() if s is None]
    if unshaped:
        return no_shape(CheckName.ALL_REDUCE, unshaped[0]).model_copy(update={"nodes": list(nodes)})
    named = {n: s for n, s in shapes.items() if s is not None}
    kinds = sorted({name for name, _ in named.values()})
    if len(kinds) > 1:
        why = f"the nodes have different shapes ({', '.join(kinds)}): one all-reduce judges one shape"
        return not_run(CheckName.ALL_REDUCE, nodes, why)
    if unfit := _guard(rt, nodes):
        return not_run(CheckName.ALL_REDUCE, nodes, f"all-reduce not run: {unfit}")
    name, shape = named[nodes[0]]
    sizes = deep.all_reduce
    spec = AllReduceSpec(tuple(nodes), shape.gpus, sizes.min_bytes, sizes.max_bytes, sizes.step_factor)
    try:
        run = rt.backends.all_reduce.run(spec, sizes.timeout_seconds)
    except Exception as error:
        return not_run(CheckName.ALL_REDUCE, nodes, f"all-reduce: {type(error).__name__}: {error}")
    return judge_all_reduce(run, name, shape)


def all_reduce_check(
    rt: Runtime, incident_id: str | None, nodes: Sequence[str], earlier: Sequence[CheckResult]
) -> CheckResult:
    """The all-reduce across `nodes`, unless a check before it already kept one of them out."""
    started = utcnow()
    failed = [r for r in earlier if not r.passed]
    result = (
        skipped(
            CheckName.ALL_REDUCE,
            nodes,
            "not run: "
            + "; ".join(f"{r.check.value} {r.verdict.value} on {', '.join(r.nodes)}" for r in failed),
        )
        if failed
        else _all_reduce(rt, rt.policy().policy.deep_checks, nodes)
    )
    record_check(rt, incident_id, result, started)
    return result


def run_checks(
    rt: Runtime,
    incident_id: str | None,
    nodes: Sequence[str],
    checks: Collection[CheckName],
    level: int,
    note: str = "deep check: ",
) -> list[CheckResult]:
    """Every check on every node, one node after the other, then the all-reduce across them all."""
    results = [r for node in nodes for r in node_checks(rt, incident_id, node, checks, level, note)]
    if CheckName.ALL_REDUCE in checks:
        results.append(all_reduce_check(rt, incident_id, nodes, results))
    return results


def node_budget_s(deep: DeepChecks, checks: Collection[CheckName], level: int) -> float:
    """The time one node's checks may take: the NVML read, DCGM's budget for its level, and two
    loopback runs (bandwidth, latency) per RDMA device of the shape with the most."""
    dcgm = LEVEL_BUDGET_S[level] if CheckName.DCGM in checks else 0.0
    devices = max((len(shape.rdma_devices) for shape in deep.shapes.values()), default=0)
    nic = 2 * deep.nic_loopback.timeout_seconds * devices if CheckName.NIC_LOOPBACK in checks else 0.0
    return PROBE_TIMEOUT_S + dcgm + nic + SLACK_S


def all_reduce_budget_s(deep: DeepChecks) -> float:
    return deep.all_reduce.timeout_seconds + SLACK_S


@task(name="deep check node", task_run_name="deep check {node}")
def check_node(incident_id: str | None, node: str, checks: list[CheckName], level: int) -> list[CheckResult]:
    return node_checks(current(), incident_id, node, checks, level, "deep check: ")


@task(name="deep check all-reduce", task_run_name="all-reduce across {nodes}")
def check_all_reduce(incident_id: str | None, nodes: list[str], earlier: list[CheckResult]) -> CheckResult:
    return all_reduce_check(current(), incident_id, nodes, earlier)
