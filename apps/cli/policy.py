"""`medic policy ...`: check, explain and test policy files; print their schema."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from apps.cli._common import EventsArgument, console, err, load_policy_or_exit, report_rejections
from medic.intake import read_file
from medic.policy import PolicyError, load_policy
from medic.policy.explain import describe, trace
from medic.policy.model import Policy
from medic.policy.testing import default_tests_path, load_tests, run_tests
from medic.triage import replay

policy_app = typer.Typer(help="Check and inspect policy files.", no_args_is_help=True)


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
    loaded = load_policy_or_exit(file)
    intake = read_file(events)
    report_rejections(intake)
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
    loaded = load_policy_or_exit(file)
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
