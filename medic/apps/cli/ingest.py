"""`medic ingest`: events in, incidents remediated through the flows (`--dry-run`: what would be done).

The flows and the Prefect runner are imported inside `ingest`: its `--help` starts without Prefect.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from medic.apps.cli import render
from medic.apps.cli._common import (
    EventsArgument,
    PolicyOption,
    console,
    err,
    report_rejections,
    runtime_or_exit,
)
from medic.apps.cli.plan import plan_steps
from medic.errors import PermanentError
from medic.incidents import Incident
from medic.intake import Intake
from medic.intake import read_file as read_all
from medic.tasks.runtime.process import Runtime
from medic.triage import replay


def ingest(
    events: EventsArgument,
    policy: PolicyOption = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print what would be done against the live fleet; change nothing."),
    ] = False,
) -> None:
    """Store events, group them into incidents and remediate each through the flows."""
    from medic.apps.cli.prefect_run import run_flows
    from medic.flows.dispatch import remediate_all

    rt = runtime_or_exit(policy)
    intake = read_all(events)
    if dry_run:
        _dry_run(rt, intake)
        return
    dispatch = run_flows(remediate_all(rt, intake))
    report_rejections(intake)
    console.print(render.incidents_table(rt.store.get_incidents([i.id for i in dispatch.incidents])))
    for incident_id, why in dispatch.failed:
        err.print(f"[red]incident {incident_id} failed:[/red] {why}")
    if dispatch.failed:
        raise typer.Exit(1)


def _dry_run(rt: Runtime, intake: Intake) -> None:
    """Decide on every incident with the live fleet size and out-of-service nodes; act on nothing."""
    report_rejections(intake)
    known = rt.store.known_event_ids(e.id for e in intake.events)
    fresh = [e for e in intake.events if e.id not in known]
    nodes = rt.backends.scheduler.nodes()
    loaded = rt.policy()
    table = Table(title="Dry run: what would be done (nothing was changed)", title_justify="left")
    for column in ("incident", "node", "decision", "would do"):
        table.add_column(column, overflow="fold")
    for result in replay(fresh, loaded, fleet_size=len(nodes), nodes=nodes):
        d = result.decision
        jobs = _jobs_on(rt, result.incident) or result.incident.jobs
        policy = loaded.policy
        steps = plan_steps(
            d,
            result.incident.node,
            result.incident.id,
            jobs,
            policy.defaults.verify_level,
            policy.deep_checks,
        )
        table.add_row(
            result.incident.id, result.incident.node, f"{d.action.value} ({d.rule})", "\n".join(steps)
        )
    console.print(table)


def _jobs_on(rt: Runtime, incident: Incident) -> list[str]:
    """The jobs the scheduler reports on the incident's node; none for a switch, or a node it does
    not know (the plan then shows the jobs the events name)."""
    if incident.scope == "switch":
        return []
    try:
        return [j.id for j in rt.backends.scheduler.jobs_on_node(incident.node)]
    except PermanentError as error:
        err.print(f"[yellow]{escape(incident.id)}:[/yellow] {escape(str(error))}")
        return []
