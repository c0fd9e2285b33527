"""The `medic` command line (docs/cli.md)."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from medic.cli import render
from medic.cli.advise import advise_app
from medic.cli.agent import agent
from medic.cli.dcgm import dcgm_app
from medic.cli.serve import emit, serve
from medic.config import load_settings
from medic.intake import read_file
from medic.policy import LoadedPolicy, PolicyError, load_policy

app = typer.Typer(
    name="medic",
    help="GPU Medic: automated fault remediation for GPU training clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
policy_app = typer.Typer(help="Check and inspect policy files.", no_args_is_help=True)
app.add_typer(policy_app, name="policy")
app.add_typer(dcgm_app, name="dcgm")
app.add_typer(advise_app, name="advise")
app.command("serve")(serve)
app.command("agent")(agent)
app.command("emit")(emit)

console = Console()
err = Console(stderr=True, soft_wrap=True)  # diagnostics stay one grep-able file:line line each

PolicyOption = Annotated[
    Path | None,
    typer.Option("--policy", "-p", help="Policy file (default: $MEDIC_POLICY or policies/default.yaml)."),
]
EventsArgument = Annotated[
    Path, typer.Argument(help="Events, one JSON object per line.", exists=True, dir_okay=False)
]


def _policy(path: Path | None) -> LoadedPolicy:
    try:
        return load_policy(path or load_settings().policy_path)
    except PolicyError as error:
        err.print(f"[red]policy error[/red]\n{error}")
        raise typer.Exit(2) from None


def _report_rejections(intake_rejected: list, duplicates: list[str]) -> None:  # type: ignore[type-arg]
    for rejection in intake_rejected:
        err.print(f"[yellow]rejected[/yellow] {escape(str(rejection))}")
    if duplicates:
        err.print(f"[dim]ignored {len(duplicates)} repeated event ids[/dim]")


@app.command()
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
    from medic.triage import triage as run_triage
    from medic.triage import triage_line

    loaded = _policy(policy)
    intake = read_file(events)
    _report_rejections(intake.rejected, intake.duplicates)
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


def _runtime(policy: Path | None, database_url: str | None = None):  # type: ignore[no-untyped-def]
    from integrations.registry import BackendError, from_settings
    from medic.store import Store
    from tasks.runtime import Runtime, configure

    settings = load_settings()
    loaded = _policy(policy)
    try:
        backends = from_settings(settings)
    except BackendError as error:
        err.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None
    return configure(Runtime(Store(database_url or settings.database_url), backends, Path(loaded.path)))


@app.command()
def ingest(
    events: EventsArgument,
    policy: PolicyOption = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print what would be done against the live fleet; change nothing."),
    ] = False,
) -> None:
    """Store events, group them into incidents and remediate each through the flows."""
    from flows.dispatch import remediate_all
    from medic.cli.prefect_run import run_flows

    rt = _runtime(policy)
    intake = read_file(events)
    if dry_run:
        _dry_run(rt, intake)
        return
    dispatch = run_flows(remediate_all(rt, intake))
    _report_rejections(intake.rejected, intake.duplicates)
    console.print(render.incidents_table([rt.store.get_incident(i.id) for i in dispatch.incidents]))  # type: ignore[misc]
    for incident_id, why in dispatch.failed:
        err.print(f"[red]incident {incident_id} failed:[/red] {why}")
    if dispatch.failed:
        raise typer.Exit(1)


def _dry_run(rt, intake) -> None:  # type: ignore[no-untyped-def]
    """Decide on every incident with the live fleet size and out-of-service nodes; act on nothing."""
    from medic.cli.plan import plan_steps
    from medic.triage import replay

    _report_rejections(intake.rejected, intake.duplicates)
    known = rt.store.known_event_ids(e.id for e in intake.events)
    fresh = [e for e in intake.events if e.id not in known]
    nodes = rt.backends.scheduler.nodes()
    loaded = rt.policy()
    table = Table(title="Dry run: what would be done (nothing was changed)", title_justify="left")
    for column in ("incident", "node", "decision", "would do"):
        table.add_column(column, overflow="fold")
    for result in replay(fresh, loaded, fleet_size=len(nodes)):
        d = result.decision
        jobs = [
            j.id for j in rt.backends.scheduler.jobs_on_node(result.incident.node)
        ] or result.incident.jobs
        steps = plan_steps(
            d, result.incident.node, result.incident.id, jobs, loaded.policy.defaults.verify_level
        )
        table.add_row(
            result.incident.id, result.incident.node, f"{d.action.value} ({d.rule})", "\n".join(steps)
        )
    console.print(table)


def _since(value: str | None) -> datetime | None:
    if not value:
        return None
    units = {"m": "minutes", "h": "hours", "d": "days"}
    if value[-1] in units and value[:-1].isdigit():
        return datetime.now(UTC) - timedelta(**{units[value[-1]]: int(value[:-1])})
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter("use an RFC 3339 time or a span like 30m, 6h, 7d") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@app.command()
def incidents(
    node: Annotated[str | None, typer.Option(help="Incidents with any event on this node.")] = None,
    job: Annotated[str | None, typer.Option(help="Incidents with any event from this job.")] = None,
    owner: Annotated[str | None, typer.Option(help="Incidents of this job owner.")] = None,
    since: Annotated[str | None, typer.Option(help="RFC 3339 time or a span: 30m, 6h, 7d.")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Find incidents in the store: "which jobs did this node touch?", "everything for job J"."""
    from medic.store import Store

    store = Store(load_settings().database_url)
    rows = store.find_incidents(node=node, job=job, owner=owner, since=_since(since))
    if as_json:
        for row in rows:
            sys.stdout.write(row.model_dump_json() + "\n")
        return
    console.print(render.incidents_table(rows, title=f"{len(rows)} incidents"))


@app.command()
def incident(incident_id: str) -> None:
    """Everything the store recorded for one incident, step by step."""
    from medic.store import Store

    detail = Store(load_settings().database_url).incident_detail(incident_id)
    if detail is None:
        err.print(f"[red]no incident {incident_id}[/red]")
        raise typer.Exit(1)
    console.print(render.incident_view(detail))


@policy_app.command("check")
def policy_check(files: Annotated[list[Path], typer.Argument(help="Policy files.")]) -> None:
    """Validate policy files; problems are printed as file:line:column: message."""
    failed = False
    for path in files:
        try:
            loaded = load_policy(path)
        except PolicyError as error:
            failed = True
            for problem in error.problems:
                err.print(str(problem), markup=False, highlight=False)
            continue
        console.print(f"{path}: ok ({len(loaded.policy.rules)} rules, sha256 {loaded.sha256[:12]})")
    if failed:
        raise typer.Exit(1)


@policy_app.command("schema")
def policy_schema(
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write to this file.")] = None,
) -> None:
    """The policy JSON Schema, for editors (`# yaml-language-server: $schema=...`)."""
    from medic.policy.model import Policy

    text = json.dumps(Policy.model_json_schema(), indent=2) + "\n"
    if output:
        output.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)


@policy_app.command("explain")
def policy_explain(
    file: Annotated[Path, typer.Argument(help="Policy file.")],
    events: EventsArgument,
    fleet_size: Annotated[int | None, typer.Option(min=1, help="Nodes in the fleet.")] = None,
) -> None:
    """For each incident: the facts, every rule that matched or why not, and the winner."""
    from medic.policy.explain import describe, trace
    from medic.triage import replay

    loaded = _policy(file)
    intake = read_file(events)
    _report_rejections(intake.rejected, intake.duplicates)
    for result in replay(intake.events, loaded, fleet_size):
        decision = result.decision
        console.rule(f"{result.incident.id} on {result.incident.subject}")
        facts = Table.grid(padding=(0, 2))
        for name, value in describe(result.facts).items():
            facts.add_row(name, value)
        console.print(facts)
        rules = Table(title_justify="left")
        for column in ("rule", "action", "matched", "because / failed on"):
            rules.add_column(column, overflow="fold")
        for t in trace(loaded.policy, result.facts):
            if t.matched:
                status, why = "[green]yes[/green]", "; ".join(t.reasons)
            else:
                status, why = "[dim]no[/dim]", t.note or f"`{t.failed_on}` does not hold"
            rules.add_row(t.rule, t.action, status, why)
        console.print(rules)
        winner = (
            f"[bold]{decision.action.value}[/bold] ({decision.classification.value}) by rule {decision.rule}"
        )
        if decision.owner:
            winner += f", told to {decision.owner}"
        console.print(
            f"Decision: {winner}. Precedence: override, then action rank, then priority, then order."
        )
        if decision.guardrail:
            console.print(
                f"[magenta]Guardrail {decision.guardrail}[/magenta] stopped {decision.blocked_action}."
            )
        console.print(f"[dim]{decision.reason}[/dim]")


@policy_app.command("test")
def policy_test(
    file: Annotated[Path, typer.Argument(help="Policy file.")],
    tests: Annotated[Path | None, typer.Argument(help="Tests (default: FILE's stem + .tests.yaml).")] = None,
) -> None:
    """Run the policy's test cases; a failure prints what was expected and what came out."""
    from medic.policy.testing import default_tests_path, load_tests, run_tests

    loaded = _policy(file)
    path = tests or default_tests_path(file)
    try:
        cases = load_tests(path)
        results = run_tests(loaded, cases)
    except PolicyError as error:
        err.print(str(error), markup=False, highlight=False)
        raise typer.Exit(2) from None
    except ValueError as error:
        err.print(f"{path}: {error}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    failed = [r for r in results if not r.passed]
    for result in results:
        mark = "[green]PASS[/green]" if result.passed else "[red]FAIL[/red]"
        console.print(f"{mark} {escape(result.name)} [dim]({result.rule})[/dim]")
        for difference in result.differences:
            console.print(f"     [red]- {escape(difference)}[/red]")
    console.print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if failed:
        raise typer.Exit(1)


breaker_app = typer.Typer(
    help="The circuit breaker: opened by a storm, closed by a human.", no_args_is_help=True
)
app.add_typer(breaker_app, name="breaker")


@breaker_app.command("status")
def breaker_status() -> None:
    """Is the breaker open, since when, and why."""
    from medic.store import Store

    row = Store(load_settings().database_url).open_breaker_record()
    if row is None:
        console.print("closed: remediation may take nodes out of service")
        return
    console.print(
        f"[bold red]open[/bold red] since {row.opened_at:%Y-%m-%d %H:%M:%S} (incident {row.incident_id})"
    )
    console.print(row.reason)
    raise typer.Exit(3)


@breaker_app.command("close")
def breaker_close(by: Annotated[str, typer.Option(help="Who closes it (kept in the store).")]) -> None:
    """Close the breaker after the storm has been looked at."""
    from medic.store import Store

    row = Store(load_settings().database_url).close_breaker(by)
    console.print(
        "it was not open" if row is None else f"closed by {by}; opened {row.opened_at:%Y-%m-%d %H:%M:%S}"
    )


@app.command()
def demo(
    keep: Annotated[bool, typer.Option(help="Keep the demo's earlier incidents in the store.")] = False,
) -> None:
    """Run a simulated 8-node fleet through real Prefect flows (no servers to set up)."""
    from flows.dispatch import remediate_all
    from medic.cli import demo as scenario_mod
    from medic.cli.prefect_run import run_flows
    from medic.intake import read_lines
    from medic.store import Store
    from tasks.runtime import Runtime, configure

    settings = load_settings()
    database = settings.home / "demo.db"
    if not keep:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{database}{suffix}").unlink(missing_ok=True)
    scenario = scenario_mod.build_scenario()
    events_file = scenario_mod.write_events(scenario.lines, settings.home / "demo-events.jsonl")
    backends, notifier = scenario_mod.simulated_backends(scenario)
    loaded = _policy(None)
    store = Store(f"sqlite:///{database}")
    rt = configure(Runtime(store, backends, Path(loaded.path)))

    console.rule("[bold]GPU Medic demo[/bold]: 8 simulated nodes, 2 training jobs")
    for line in scenario.story:
        console.print(f"  • {line}")
    console.print(f"[dim]events: {events_file}; store: {database}; policy: {loaded.path}[/dim]\n")
    intake = read_lines(scenario.lines, events_file.name)
    dispatch = run_flows(remediate_all(rt, intake))

    console.print(render.rejections_table(intake.rejected))
    console.print(render.incidents_table([store.get_incident(i.id) for i in dispatch.incidents]))  # type: ignore[misc]
    outcomes = Table(title="Outcomes", title_justify="left")
    for column in ("incident", "node", "diagnostics", "outcome"):
        outcomes.add_column(column, overflow="fold")
    for o in dispatch.outcomes:
        outcomes.add_row(o.incident, o.node, ", ".join(o.diagnostics) or "-", o.summary)
    console.print(outcomes)
    console.print(_stage_times(store, [i.id for i in dispatch.incidents]))
    console.rule("Messages for the owners")
    for thread in notifier.threads.values():
        console.print(render.message_panel(thread.message, thread.replies))
    console.print(
        "\nNext: [bold]prefect flow-run ls[/bold] shows the runs; "
        f"[bold]MEDIC_DATABASE_URL=sqlite:///{database} medic incident <id>[/bold] shows one step by step."
    )
    if dispatch.failed:
        raise typer.Exit(1)


def _stage_times(store, incident_ids: list[str]) -> Table:  # type: ignore[no-untyped-def]
    from medic.cli.demo import stage_columns

    columns = list(stage_columns())
    table = Table(title="Seconds per stage", title_justify="left")
    table.add_column("incident")
    for column in columns:
        table.add_column(column, justify="right")
    for incident_id in incident_ids:
        detail = store.incident_detail(incident_id)
        spent = dict.fromkeys(columns, 0.0)
        for step in detail.steps:
            key = next((c for c in columns if step.stage.startswith(c.split()[0])), None)
            if key:
                spent[key] += (step.finished_at - step.started_at).total_seconds()
        table.add_row(incident_id, *(f"{spent[c]:.3f}" if spent[c] else "-" for c in columns))
    return table


@app.command()
def goodput(
    job: Annotated[str | None, typer.Option(help="Only this job.")] = None,
    save_seconds: Annotated[
        float | None, typer.Option(help="Checkpoint save time, to add checkpoint overhead to downtime.")
    ] = None,
    interval_seconds: Annotated[float | None, typer.Option(help="Seconds between checkpoints.")] = None,
) -> None:
    """What incidents cost each job: detection, diagnosis, action, recovery, lost work, downtime."""
    from medic.goodput import IncidentCost, job_goodput
    from medic.store import Store

    rows = Store(load_settings().database_url).goodput(job)
    costs = [
        IncidentCost(
            r.incident_id,
            r.job,
            r.fault_at,
            r.detection_s,
            r.diagnosis_s,
            r.action_s,
            r.recovery_s,
            r.lost_work_s,
        )
        for r in rows
    ]
    per_incident = Table(title="Per incident (seconds)", title_justify="left")
    for column in (
        "incident",
        "job",
        "fault at",
        "detection",
        "diagnosis",
        "action",
        "recovery",
        "lost work",
    ):
        per_incident.add_column(column, justify="right" if column not in ("incident", "job") else "left")

    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    for c in costs:
        per_incident.add_row(
            c.incident,
            c.job,
            f"{c.fault_at:%Y-%m-%d %H:%M:%S}",
            s(c.detection_s),
            s(c.diagnosis_s),
            s(c.action_s),
            s(c.recovery_s),
            s(c.lost_work_s),
        )
    console.print(per_incident)
    per_job = Table(
        title="Per job: downtime = checkpoint overhead + Σ (detection + recovery)", title_justify="left"
    )
    for column in (
        "job",
        "failures",
        "detection",
        "recovery",
        "lost work",
        "checkpoint overhead",
        "downtime",
    ):
        per_job.add_column(column, justify="left" if column == "job" else "right")
    for name in sorted({c.job for c in costs}):
        mine = [c for c in costs if c.job == name]
        overhead = None
        if save_seconds and interval_seconds and mine:
            span = (max(c.fault_at for c in mine) - min(c.fault_at for c in mine)).total_seconds()
            overhead = save_seconds / interval_seconds * span
        total = job_goodput(mine, overhead)
        per_job.add_row(
            name,
            str(total.failures),
            s(total.detection_s),
            s(total.recovery_s),
            s(total.lost_work_s),
            s(total.checkpoint_overhead_s),
            s(total.downtime_s),
        )
    console.print(per_job)


@app.command()
def schema() -> None:
    """Print the fault-event JSON Schema (docs/events.md)."""
    from medic.events import FaultEvent

    sys.stdout.write(json.dumps(FaultEvent.model_json_schema(), indent=2) + "\n")


def main() -> None:
    try:
        app()
    except PolicyError as error:  # a broken config file: file:line:column, no traceback
        err.print(str(error), markup=False, highlight=False)
        raise SystemExit(2) from None
