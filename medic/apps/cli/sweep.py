"""`medic sweep plan|run`: deep-check idle nodes before a job meets their fault (docs/sweeps.md)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from medic.apps.cli._common import PolicyOption, console, err, runtime_or_exit
from medic.sweep import SweepPlan, SweepSettings

sweep_app = typer.Typer(help="Scheduled deep checks of idle nodes, the riskiest first.", no_args_is_help=True)

LevelOption = Annotated[int, typer.Option(min=1, max=4, help="The DCGM level run on each node.")]
MaxNodesOption = Annotated[int, typer.Option(min=1, help="Nodes one sweep checks at most.")]
MinutesOption = Annotated[
    int, typer.Option(min=1, help="How long each node is held (never less than the level's budget).")
]
StaleOption = Annotated[float, typer.Option(min=0.01, help="Hours after which a node's deep check is stale.")]
AtRiskOption = Annotated[
    float, typer.Option(min=0.01, help="Hours after which a node with ageing evidence is due again.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="One JSON document (docs/sweeps.md#json).")]


def _settings(level: int, max_nodes: int, minutes: int, stale: float, at_risk: float) -> SweepSettings:
    return SweepSettings(
        level=level,
        max_nodes=max_nodes,
        reservation_minutes=minutes,
        stale_after_hours=stale,
        at_risk_after_hours=at_risk,
    )


def _refused(error: Exception) -> typer.Exit:
    err.print(f"[red]error:[/red] {escape(str(error))}")
    return typer.Exit(2)


@sweep_app.command("plan")
def plan_command(
    level: LevelOption = 2,
    max_nodes: MaxNodesOption = 2,
    reservation_minutes: MinutesOption = 30,
    stale_after_hours: StaleOption = 168,
    at_risk_after_hours: AtRiskOption = 24,
    as_json: JsonOption = False,
    policy: PolicyOption = None,
) -> None:
    """What the next sweep would check, in order, and why; and why every other node is left.
    Changes nothing. Exit status 2 when the scheduler has no reservations (nothing is ever swept)."""
    from medic.tasks.sweep import NoReservationsError, make_plan

    rt = runtime_or_exit(policy)
    settings = _settings(level, max_nodes, reservation_minutes, stale_after_hours, at_risk_after_hours)
    try:
        planned = make_plan(rt, settings)
    except NoReservationsError as error:
        raise _refused(error) from None
    if as_json:
        sys.stdout.write(planned.model_dump_json(indent=2) + "\n")
        return
    _print(planned)


@sweep_app.command("run")
def run_command(
    level: LevelOption = 2,
    max_nodes: MaxNodesOption = 2,
    reservation_minutes: MinutesOption = 30,
    stale_after_hours: StaleOption = 168,
    at_risk_after_hours: AtRiskOption = 24,
    remediate: Annotated[
        bool, typer.Option(help="Hand failing nodes to remediation (--no-remediate: only report them).")
    ] = True,
    as_json: JsonOption = False,
    policy: PolicyOption = None,
) -> None:
    """Run one sweep now through the `sweep` flow, as the deployment's schedule does. Exit status: 0
    every node checked passed, 1 a node failed, 3 a check gave no verdict, 2 no reservations."""
    from medic.apps.cli.prefect_run import run_flows
    from medic.flows.sweep import sweep
    from medic.tasks.sweep import NoReservationsError

    rt = runtime_or_exit(policy)
    settings = _settings(level, max_nodes, reservation_minutes, stale_after_hours, at_risk_after_hours)
    try:
        report = run_flows(sweep(settings, remediate))
    except NoReservationsError as error:
        raise _refused(error) from None
    finally:
        rt.store.close()
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        _print(report.plan)
        table = Table(title=f"Sweep {report.sweep}", title_justify="left")
        for column in ("node", "result", "detail"):
            table.add_column(column, overflow="fold")
        for swept in report.nodes:
            table.add_row(escape(swept.node), swept.result, escape(swept.detail))
        console.print(table)
        for handed in report.handed_on:
            done = handed.action or "remediation did not finish here"
            console.print(
                f"{escape(handed.node)}: handed to remediation as incident {handed.incident}: {done}"
            )
    results = {n.result for n in report.nodes}
    raise typer.Exit(1 if "fail" in results else 3 if "error" in results else 0)


def _print(planned: SweepPlan) -> None:
    s = planned.settings
    title = (
        f"Next sweep: DCGM level {s.level} on {len(planned.picks)} of at most {s.max_nodes} nodes "
        f"(stale after {s.stale_after_hours:g} h, at risk after {s.at_risk_after_hours:g} h)"
    )
    if not planned.picks:
        console.print(f"{title}: no node is due.")
    else:
        table = Table(title=title, title_justify="left")
        for column in ("order", "node", "score", "last deep check", "why"):
            table.add_column(column, justify="right" if column in ("order", "score") else "left")
        for order, pick in enumerate(planned.picks, start=1):
            last = "never" if pick.last_check is None else f"{pick.last_check:%Y-%m-%d %H:%M}"
            table.add_row(
                str(order), escape(pick.node), f"{pick.score:g}", last, escape("\n".join(pick.reasons))
            )
        console.print(table)
    if planned.skipped:
        left = Table(title="Not in this sweep", title_justify="left")
        left.add_column("node")
        left.add_column("why")
        for skip in planned.skipped:
            left.add_row(escape(skip.node), escape(skip.why))
        console.print(left)
