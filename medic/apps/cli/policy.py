"""`medic policy ...`: check, explain and test policy files; print their schema."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from medic.apps.cli._common import console, err, load_policy_or_exit, report_rejections
from medic.config import load_settings
from medic.intake import read_file
from medic.policy import Mode, PolicyError, groups, load_policy
from medic.policy.explain import describe, trace
from medic.policy.guardrails import UNGUARDED
from medic.policy.model import Policy
from medic.policy.selectors import OTHER_NODES
from medic.protocols import NodeInfo, NodeState
from medic.shipped import SHIPPED_POLICY
from medic.triage import replay
from medic.whatif.replay import ChangeLimit
from medic.whatif.replay_report import ChangedIncident, Count, GroupResult, ReplayReport
from medic.whatif.testing import default_tests_path, load_tests, run_tests

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
        policy = loaded.policy
        grouped = f", {len(policy.groups)} node groups" if policy.groups else ""
        console.print(f"{path}: ok ({len(policy.rules)} rules{grouped}, sha256 {loaded.sha256[:12]})")
    if failed:
        raise typer.Exit(1)


@policy_app.command("init")
def policy_init(
    path: Annotated[
        Path, typer.Argument(help="Where to write the policy; its test cases go beside it.")
    ] = Path("policies/default.yaml"),
    force: Annotated[bool, typer.Option("--force", help="Replace files that exist.")] = False,
) -> None:
    """Write the shipped default policy and its test cases to PATH, for SREs to edit and own.

    Point MEDIC_POLICY (or the config file's `policy:`) at the copy; `medic policy test` runs its cases.
    """
    copies = {SHIPPED_POLICY: path, default_tests_path(SHIPPED_POLICY): default_tests_path(path)}
    existing = [str(target) for target in copies.values() if target.exists()]
    if existing and not force:
        err.print(f"error: {', '.join(existing)} exists; --force replaces it", markup=False, highlight=False)
        raise typer.Exit(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    for shipped, target in copies.items():
        target.write_bytes(shipped.read_bytes())
        console.print(f"wrote {target}", markup=False, highlight=False)


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
    events: Annotated[
        Path | None,
        typer.Argument(help="Events, one JSON object per line (none: only --node's group).", dir_okay=False),
    ] = None,
    fleet_size: Annotated[int | None, typer.Option(min=1, help="Nodes in the fleet.")] = None,
    node: Annotated[str | None, typer.Option(help="Say which group this node is in, and why.")] = None,
    partition: Annotated[
        list[str] | None, typer.Option(help="The node's partitions, as the scheduler lists them (repeat).")
    ] = None,
    feature: Annotated[list[str] | None, typer.Option(help="The node's features (repeat).")] = None,
    gpu_model: Annotated[str | None, typer.Option(help="Its GPUs' type, as gres names it (h100).")] = None,
    gpus: Annotated[int | None, typer.Option(min=1, help="Its number of GPUs.")] = None,
) -> None:
    """For each incident: the node's group and mode, the facts, every rule that matched or why not, and
    the winner. With --node (and what the scheduler says of it), the group that node is in and why."""
    loaded = load_policy_or_exit(file)
    if events is None and node is None:
        err.print("error: give EVENTS, --node, or both", markup=False, highlight=False)
        raise typer.Exit(2)
    if events is not None and not events.is_file():
        err.print(f"error: {events} is not a file", markup=False, highlight=False)
        raise typer.Exit(2)
    given = NodeInfo(
        name=node or "",
        state=NodeState.UNKNOWN,
        gpus=gpus or 0,
        partitions=tuple(partition) if partition is not None else None,
        features=tuple(feature) if feature is not None else None,
        gpu_model=gpu_model,
    )
    if node is not None:
        _print_placement(groups.place(loaded.policy, given))
    if events is None:
        return
    intake = read_file(events)
    report_rejections(intake)
    for result in replay(intake.events, loaded, fleet_size, [given] if node else []):
        console.rule(f"{result.incident.id} on {result.incident.subject}")
        decision, placement = result.decision, result.placement
        effective = groups.policy_for(loaded.policy, placement.group)  # the rules it was decided with
        _print_placement(placement)
        facts = Table.grid(padding=(0, 2))
        for name, value in describe(result.facts).items():
            facts.add_row(name, value)
        console.print(facts)
        rules = Table(title_justify="left")
        for column in ("rule", "action", "matched", "because / failed on"):
            rules.add_column(column, overflow="fold")
        for t in trace(effective, result.facts):
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
        if groups.observed(decision):
            console.print(
                f"[yellow]Observe mode[/yellow]: GPU Medic would only say it would {decision.action.value}."
            )
        if decision.guardrail:
            console.print(
                f"[magenta]Guardrail {decision.guardrail}[/magenta] stopped {decision.blocked_action}."
            )
        console.print(f"[dim]{escape(decision.reason)}[/dim]")


def _print_placement(placement: groups.Placement) -> None:
    mode = f"[bold]{placement.mode.value}[/bold]"
    if placement.problem:
        console.print(f"Group: [red]undecidable[/red], mode {mode}: {escape(placement.problem)}")
    else:
        console.print(f"Group: {placement.group_name or '(none)'}, mode {mode}: {escape(placement.why)}")


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


SHOWN = 50  # changed incidents, nodes and trips listed in the terminal; --json lists every one


def _change_limit(value: str | None) -> ChangeLimit | None:
    try:
        return ChangeLimit.parse(value) if value is not None else None
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


@policy_app.command("replay")
def policy_replay(
    file: Annotated[Path, typer.Argument(help="The policy to replay the store's incidents with.")],
    since: Annotated[
        str | None, typer.Option(help="Incidents opened since: RFC 3339 time or a span (30m, 6h, 30d).")
    ] = None,
    store_url: Annotated[
        str | None, typer.Option("--store", help="Store URL (default: $MEDIC_DATABASE_URL).")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON document (docs/policy.md#replay).")
    ] = False,
    max_changed: Annotated[
        ChangeLimit | None,
        typer.Option(
            parser=_change_limit,
            metavar="N|P%",
            help="Exit 1 when more incidents than this change: a count (5) or a share of them (2%).",
        ),
    ] = None,
) -> None:
    """Decide every recorded incident again with FILE, on the facts recorded at the time, and show
    what would differ. Exit 1 over --max-changed, 2 for an invalid policy."""
    # The store (SQLAlchemy) is the control plane's: imported here, so that `medic policy check`, `explain`,
    # `test` and `init` run from the node bundle too (gpu-medic[node], docs/install.md).
    from medic.apps.cli._common import parse_since
    from medic.apps.cli.replay_parallel import replay_store
    from medic.store import Store

    loaded = load_policy_or_exit(file)
    started = parse_since(since)
    store = Store(store_url or load_settings().database_url)
    # Weeks of decisions and events are read and compared in one go, allocating millions of objects
    # that live until the end and hold no cycles: the collector would walk them again and again
    # (a third of the replay's time) and could free nothing.
    gc.disable()
    try:
        report = replay_store(store, loaded, started)
    finally:
        gc.enable()
        store.close()
    exceeded = [why for why in [max_changed.exceeded_by(report)] if why] if max_changed else []
    report = report.model_copy(
        update={
            "exceeded": exceeded,
            "changes": [
                c.model_copy(update={"flow_run_url": _flow_run_url(c.flow_run_id)}) if c.flow_run_id else c
                for c in report.changes
            ],
        }
    )
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        _print_replay(report)
    if exceeded:
        raise typer.Exit(1)


def _flow_run_url(flow_run_id: str) -> str | None:
    """The run's page in the Prefect UI, when Prefect knows the UI's address (PREFECT_UI_URL)."""
    # Imported here: Prefect takes seconds to import, and only a replay with runs to link needs it
    # (`medic` commands that do not orchestrate must not load it: tests/entrypoints/test_cli_triage.py).
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=flow_run_id)


def _counts_table(title: str, counts: dict[str, Count]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in (title.split()[0].lower().rstrip("s"), "before", "after", "change"):
        table.add_column(column, justify="left" if column in ("action", "rule") else "right")
    for name, count in counts.items():
        delta = count.after - count.before
        table.add_row(name, str(count.before), str(count.after), f"{delta:+d}" if delta else "")
    return table


def _print_replay(report: ReplayReport) -> None:
    console.print(
        f"Replayed {report.incidents} incidents ({report.decisions} decisions) with {escape(report.policy)} "
        f"(sha256 {report.policy_sha256[:12]}): [bold]{report.changed} changed[/bold] "
        f"({report.changed_percent:.1f}%)."
    )
    if report.rebuilt or report.skipped:
        console.print(
            f"{report.rebuilt} decisions had their facts rebuilt from the stored events (recorded before "
            f"facts were kept); {report.skipped} skipped (their events are no longer in the store)."
        )
    if not report.decisions:
        return
    console.print(_counts_table("Actions (each incident's last decision)", report.actions))
    console.print(_counts_table("Rules (each incident's last decision)", report.rules))
    if any(g.group != OTHER_NODES or g.would_have.before or g.would_have.after for g in report.groups):
        console.print(_groups_table(report.groups))
    if report.changes:
        table = Table(
            title=f"Changed incidents ({min(SHOWN, report.changed)} of {report.changed})",
            title_justify="left",
        )
        for column in ("incident", "node", "group", "before", "after", "record"):
            table.add_column(column, overflow="fold")
        for change in report.changes[:SHOWN]:
            before, after = change.before, change.after
            table.add_row(
                escape(change.incident),
                escape(change.node),
                f"{escape(change.group)} ({change.mode.value})",
                f"{' → '.join(change.steps_before)} ({before.rule}{_stopped(before.guardrail)})",
                f"{_said(change)}{' → '.join(change.steps_after)} ({after.rule}{_stopped(after.guardrail)})",
                escape("\n".join(filter(None, [change.command, change.flow_run_url]))),
            )
        console.print(table)
    if report.nodes:
        table = Table(title="Nodes taken out of service more or less often", title_justify="left")
        for column in ("node", "before", "after"):
            table.add_column(column)
        for node in report.nodes[:SHOWN]:
            table.add_row(escape(node.node), str(node.taken_out_before), str(node.taken_out_after))
        console.print(table)
    if report.guardrails:
        table = Table(
            title=f"Guardrails that would have tripped ({len(report.guardrails)})", title_justify="left"
        )
        for column in ("incident", "node", "at", "guardrail", "stopped", "why"):
            table.add_column(column, overflow="fold")
        for trip in report.guardrails[:SHOWN]:
            guardrail = trip.guardrail + ("" if trip.recorded else " [yellow](new)[/yellow]")
            table.add_row(
                escape(trip.incident),
                escape(trip.node),
                f"{trip.decided_at:%Y-%m-%d %H:%M:%S}",
                guardrail,
                trip.blocked_action.value,
                escape(trip.reason),
            )
        console.print(table)
    for why in report.exceeded:
        err.print(f"[red]over the limit:[/red] {escape(why)}")


def _groups_table(rows: list[GroupResult]) -> Table:
    """Each group's incidents, by their last decision: node actions carried out, or only said (observe)."""
    table = Table(
        title="Node groups (each incident's last decision; `would have`: observe mode, nothing done)",
        title_justify="left",
    )
    for column in ("group", "mode", "incidents", "changed", "acted", "would have"):
        table.add_column(column, justify="left" if column in ("group", "mode") else "right")
    for row in rows:
        table.add_row(
            escape(row.group),
            row.mode.value,
            str(row.incidents),
            str(row.changed),
            f"{row.acted.before} → {row.acted.after}",
            f"{row.would_have.before} → {row.would_have.after}",
        )
    return table


def _said(change: ChangedIncident) -> str:
    """What comes before a node action only said (observe mode); an escalation reaches people in
    every mode (medic.policy.groups.observed)."""
    return "would have: " if change.mode is Mode.OBSERVE and change.after.action not in UNGUARDED else ""


def _stopped(guardrail: str | None) -> str:
    return f", stopped by {guardrail}" if guardrail else ""
