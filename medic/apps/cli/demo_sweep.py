"""The sweep part of `medic demo`: a GPU wearing out on an idle node, found before a job lands on it.

The node agent's readings of the last days (corrected ECC errors climbing on one GPU) go into the
demo's store as they would have arrived; DCGM level 2's memory test is scripted to fail on that GPU.
The nightly sweep then ranks the node first, holds it with a reservation, finds the fault, releases
it, and remediation takes over (docs/sweeps.md).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rich.markup import escape
from rich.table import Table

from medic.apps.cli._common import console
from medic.events import FaultEvent
from medic.integrations.sim.fleet import SimFleet
from medic.protocols import NodeState
from medic.sweep import SweepSettings
from medic.tasks.runtime.process import Runtime

READINGS_DAYS = 5
ECC_PER_DAY = 80


def degrading_node(fleet: SimFleet) -> str | None:
    """The last idle node with no job: one nothing in the scenario touched."""
    with fleet.lock:
        busy = {n for job in fleet.jobs.values() for n in job.nodes}
        idle = [n.name for n in fleet.nodes.values() if n.state is NodeState.IDLE and n.name not in busy]
    return idle[-1] if idle else None


def plant(rt: Runtime, fleet: SimFleet, node: str, gpu: int = 6) -> None:
    now = datetime.now(UTC)
    rt.store.record_history(
        FaultEvent(
            id=f"demo-sweep-ecc-{node}-{day}",
            time=now - timedelta(days=READINGS_DAYS - day, hours=1),
            source="agent",
            kind="ecc",
            node=node,
            gpu=gpu,
            attributes={"sbe": 1, "counters": {"ecc_corrected": 120 + ECC_PER_DAY * day}},
        )
        for day in range(READINGS_DAYS)
    )
    fleet.script_diagnostic(node, 2, "fail", ("DCGM_FR_FAULTY_MEMORY",))


async def run(rt: Runtime, fleet: SimFleet) -> bool:
    """Plant the degrading GPU, run one sweep, print what it did; False when nothing could be swept."""
    from medic.flows.sweep import sweep

    node = degrading_node(fleet)
    console.rule("Nightly sweep: deep checks of idle nodes, the riskiest first")
    if node is None:
        console.print("no idle node left to sweep")
        return False
    console.print(
        f"  • {node}: idle, no job; its GPU 6's corrected ECC errors have climbed {ECC_PER_DAY} a day "
        f"for {READINGS_DAYS} days (the node agent's readings); DCGM level 2's memory test will fail on it"
    )
    plant(rt, fleet, node)
    report = await sweep(SweepSettings(max_nodes=1))
    picks = Table(title="The sweep's plan", title_justify="left")
    for column in ("node", "why"):
        picks.add_column(column, overflow="fold")
    for pick in report.plan.picks:
        picks.add_row(escape(pick.node), escape("\n".join(pick.reasons)))
    console.print(picks)
    for swept in report.nodes:
        console.print(
            f"  {escape(swept.node)}: held by reservation {swept.reservation}, DCGM level {swept.level} "
            f"[bold]{swept.result}[/bold] {escape(' '.join(swept.error_ids))}, released"
        )
    for handed in report.handed_on:
        console.print(
            f"  {escape(handed.node)}: handed to remediation as incident {handed.incident}: "
            f"{handed.action or 'not finished'}, before any job was scheduled on it"
        )
    return bool(report.handed_on)
