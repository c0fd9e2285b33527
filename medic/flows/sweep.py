"""The scheduled sweep (docs/sweeps.md): deep-check idle nodes before a job meets their fault.

Plan (medic/sweep.py: the riskiest and stalest idle nodes, within the guardrails), then for every
pick at once: hold it with a reservation, run the DCGM level, release it. A node that fails is handed
to remediation as a `diagnostic` fault event through the same path `medic ingest` takes (stored
first, correlated into an incident, one remediation run), so the policy decides what happens to it.
Deployed with a cron schedule in deployments/prefect.yaml; `medic sweep run` runs it once.
"""

from __future__ import annotations

import asyncio

from prefect import flow
from prefect.artifacts import acreate_markdown_artifact
from prefect.futures import wait
from pydantic import BaseModel

from medic.flows.dispatch import remediate_all
from medic.intake import Intake
from medic.store import utcnow
from medic.sweep import SweepPlan, SweepSettings
from medic.tasks.nodes.guard import ensure_limits
from medic.tasks.runtime.process import current
from medic.tasks.runtime.stage import run_logger
from medic.tasks.sweep import NodeSwept, fault_event, make_plan, new_sweep_id, reservation_minutes, sweep_node


class HandedOn(BaseModel):
    node: str
    incident: str
    action: str | None  # what remediation did; None when its run failed or was not ours to run


class SweepReport(BaseModel):
    sweep: str
    plan: SweepPlan
    nodes: list[NodeSwept]  # one per pick, in the plan's order
    handed_on: list[HandedOn]


def _markdown(report: SweepReport) -> str:
    lines = [
        f"# Sweep {report.sweep}: {len(report.nodes)} nodes",
        "",
        "| node | result | detail |",
        "|---|---|---|",
    ]
    lines += [f"| {n.node} | {n.result} | {n.detail.replace('|', '/')} |" for n in report.nodes]
    lines += [
        f"\n{h.node}: incident {h.incident}, {h.action or 'not remediated here'}" for h in report.handed_on
    ]
    return "\n".join(lines) + "\n"


@flow(name="sweep", flow_run_name=lambda: f"sweep-{utcnow():%Y%m%dT%H%M}", persist_result=False)
async def sweep(settings: SweepSettings | None = None, remediate: bool = True) -> SweepReport:
    """One sweep with `settings` (the documented defaults when None). `remediate` False only reports
    failing nodes: their fault events are neither stored nor acted on (a dry look at the fleet)."""
    settings = settings or SweepSettings()
    rt = current()
    log = run_logger()
    await ensure_limits()
    now = utcnow()
    sweep_id = new_sweep_id(now)
    planned = make_plan(rt, settings, now)
    for pick in planned.picks:
        log.info("sweep %s picks %s: %s", sweep_id, pick.node, "; ".join(pick.reasons))
    minutes = reservation_minutes(settings)
    futures = [sweep_node.submit(sweep_id, p.node, settings.level, minutes) for p in planned.picks]
    await asyncio.to_thread(wait, futures)
    # A check that raised fails the sweep (its node was released), after the others are handed on.
    nodes = [f.result() for f in futures if f.state.is_completed()]
    failing = [n for n in nodes if n.result == "fail"]
    handed_on: list[HandedOn] = []
    if failing and remediate:
        dispatch = await remediate_all(rt, Intake(events=[fault_event(sweep_id, n) for n in failing]))
        actions = {o.incident: o.action for o in dispatch.outcomes}
        handed_on = [
            HandedOn(node=i.node, incident=i.id, action=actions.get(i.id)) for i in dispatch.incidents
        ]
        for failed, why in dispatch.failed:
            log.error("sweep %s: remediation of %s failed: %s", sweep_id, failed, why)
    report = SweepReport(sweep=sweep_id, plan=planned, nodes=nodes, handed_on=handed_on)
    for swept in nodes:
        log.info("sweep %s: %s %s", sweep_id, swept.node, swept.result)
    await acreate_markdown_artifact(markdown=_markdown(report), description=f"sweep {sweep_id}")
    for future in futures:
        future.result()  # raises what a failed check raised
    return report
