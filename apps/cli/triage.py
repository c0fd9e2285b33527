"""`medic triage`, `medic ingest` and `medic schema`: events in, decisions (and actions) out.

The flows and the Prefect runner are imported inside `ingest`: `medic triage` and `--help`
must not pay Prefect's import (tests/test_cli_triage.py checks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from apps.cli import render
from apps.cli._common import (
    EventsArgument,
    PolicyOption,
    console,
    err,
    load_policy_or_exit,
    report_rejections,
)
from apps.cli.plan import plan_steps
from integrations.registry import BackendError, from_settings
from medic.config import load_settings
from medic.errors import PermanentError
from medic.events import FaultEvent
from medic.incidents import Incident
from medic.intake import Intake, read_file
from medic.store import Store
from medic.triage import replay, triage_line
from medic.triage import triage as run_triage
from tasks.runtime import Runtime, configure


def triage(
    events: EventsArgument,
    policy: PolicyOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per incident and line.")] = False,
    fleet_size: Annotated[
        int | None,
        typer.Option(min=1, help="Nodes in the fleet, for percentage guardrails (else count limits only)."),
    ] = None,
) -> None:
    """Group events into incidents and decide on each, WITHOUT acting."""
    loaded = load_policy_or_exit(policy)
    try:
        intake = read_file(events)  # a bad line is a rejection; only an unreadable file stops here
    except OSError as error:
        err.print(
            f"[red]error:[/red] cannot read {escape(str(events))}: {escape(error.strerror or str(error))}"
        )
        raise typer.Exit(2) from None
    report_rejections(intake)
    results = list(run_triage(intake.events, loaded, fleet_size))
    if as_json:
        for incident, decision in results:
            sys.stdout.write(triage_line(incident, decision).model_dump_json() + "\n")
        return
    table = Table(title=f"Triage with {loaded.path} ({loaded.sha256[:12]})", title_justify="left")
    for column in ("incident", "nodes", "events", "class", "action", "level", "rule", "reason"):
        table.add_column(column, overflow="fold")
    for incident, decision in results:
        table.add_row(
            incident.id,
            ", ".join(incident.nodes),
            str(len(incident.events)),
            decision.classification.value,
            render.action_text(decision.action.value),
            str(decision.diagnose_level or ""),
            decision.rule,
            decision.reason,
        )
    console.print(table)


def ingest(
    events: EventsArgument,
    policy: PolicyOption = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print what would be done against the live fleet; change nothing."),
    ] = False,
) -> None:
    """Store events, group them into incidents and remediate each through the flows."""
    from apps.cli.prefect_run import run_flows
    from flows.dispatch import remediate_all

    rt = _runtime(policy)
    intake = read_file(events)
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


def _runtime(policy: Path | None) -> Runtime:
    settings = load_settings()
    loaded = load_policy_or_exit(policy)
    try:
        backends = from_settings(settings)
    except BackendError as error:  # not configured, or configured wrong: say what to set
        err.print(f"[red]error:[/red] {escape(str(error))}")
        raise typer.Exit(2) from None
    return configure(Runtime(Store(settings.database_url), backends, Path(loaded.path)))


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
    for result in replay(fresh, loaded, fleet_size=len(nodes)):
        d = result.decision
        jobs = _jobs_on(rt, result.incident) or result.incident.jobs
        steps = plan_steps(
            d, result.incident.node, result.incident.id, jobs, loaded.policy.defaults.verify_level
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


def schema() -> None:
    """Print the fault-event JSON Schema (docs/events.md)."""
    sys.stdout.write(json.dumps(FaultEvent.model_json_schema(), indent=2) + "\n")
