"""The deep health check suite as a flow (`medic check deep`, docs/deep-checks.md).

Every node's own checks (its GPUs and NVLink links read from NVML, DCGM at the policy's level, an
ib_write_bw loopback on each of its RDMA devices) run
at once, one task per node; then one all-reduce across all the nodes, unless a node already failed.
With an incident, each check's output is kept on it as evidence (medic/tasks/deep_check.py); the run's
artifact lists every verdict in Prefect's history either way.
"""

from __future__ import annotations

import asyncio

from prefect import flow
from prefect.artifacts import acreate_markdown_artifact
from prefect.futures import PrefectFuture, wait
from prefect.runtime import flow_run
from pydantic import BaseModel

from medic.deep_check import CheckResult, Verdict, not_run, overall
from medic.policy.deep_checks import CHECK_ORDER, CheckName
from medic.tasks.deep_check import all_reduce_budget_s, check_all_reduce, check_node, node_budget_s
from medic.tasks.runtime.process import current


class DeepCheckReport(BaseModel):
    nodes: list[str]
    incident: str | None
    checks: list[CheckName]
    dcgm_level: int
    verdict: Verdict
    results: list[CheckResult]


def _run_name() -> str:
    nodes = flow_run.parameters["nodes"]
    more = f"-and-{len(nodes) - 1}-more" if len(nodes) > 1 else ""
    return f"deep-check-{nodes[0]}{more}"


def _node_results(
    node: str, checks: list[CheckName], future: PrefectFuture[list[CheckResult]]
) -> list[CheckResult]:
    """The node's results; a task that did not complete (its time ran out) gives no verdict on any."""
    if future.state.is_completed():
        return future.result()
    why = f"the checks of {node} did not complete: {future.state.name} ({future.state.message})"
    return [not_run(c, [node], why) for c in checks if c is not CheckName.ALL_REDUCE]


def _markdown(report: DeepCheckReport) -> str:
    lines = [
        f"# Deep check of {', '.join(report.nodes)}: {report.verdict.value}",
        "",
        "| check | nodes | verdict | reason |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r.check.value} | {', '.join(r.nodes)} | {r.verdict.value} | {r.reason.replace('|', '/')} |"
        for r in report.results
    ]
    return "\n".join(lines) + "\n"


@flow(name="deep-check", flow_run_name=_run_name, persist_result=False)
async def deep_check(
    nodes: list[str], incident_id: str | None = None, checks: list[CheckName] | None = None
) -> DeepCheckReport:
    deep = current().policy().policy.deep_checks
    wanted = [c for c in CHECK_ORDER if checks is None or c in checks]
    level = deep.dcgm_level
    per_node = check_node.with_options(timeout_seconds=node_budget_s(deep, wanted, level))
    futures = [per_node.submit(incident_id, node, wanted, level) for node in nodes]
    await asyncio.to_thread(wait, futures)
    results = [r for node, f in zip(nodes, futures, strict=True) for r in _node_results(node, wanted, f)]
    if CheckName.ALL_REDUCE in wanted:
        reduce = check_all_reduce.with_options(timeout_seconds=all_reduce_budget_s(deep))
        state = reduce(incident_id, nodes, results, return_state=True)
        results.append(
            await state.aresult()
            if state.is_completed()
            else not_run(
                CheckName.ALL_REDUCE,
                nodes,
                f"the all-reduce did not complete: {state.name} ({state.message})",
            )
        )
    report = DeepCheckReport(
        nodes=nodes,
        incident=incident_id,
        checks=wanted,
        dcgm_level=level,
        verdict=overall(results),
        results=results,
    )
    await acreate_markdown_artifact(
        markdown=_markdown(report), description=f"deep check: {report.verdict.value}"
    )
    return report
