"""`medic check deep NODE...`: the deep health check suite through its flow (docs/deep-checks.md)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from medic.apps.cli._common import PolicyOption, console, err, runtime_or_exit
from medic.deep_check import Verdict
from medic.policy.deep_checks import CHECK_ORDER, CheckName

check_app = typer.Typer(help="Check nodes before they return to service.", no_args_is_help=True)

# A failed check and a check that gave no verdict differ for whoever acts on the exit status: the
# first is about the node, the second about the check (a tool missing, a node unreachable).
EXIT = {Verdict.PASS: 0, Verdict.FAIL: 1, Verdict.ERROR: 3}
STYLE = {Verdict.PASS: "green", Verdict.FAIL: "bold red", Verdict.ERROR: "red", Verdict.SKIPPED: "dim"}
SHAPED = frozenset(CHECK_ORDER) - {CheckName.DCGM}  # the checks that judge a node against its shape


def _usage(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {escape(message)}")
    return typer.Exit(2)


@check_app.command("deep")
def deep(
    nodes: Annotated[
        list[str], typer.Argument(help="Nodes to check; the all-reduce runs across all of them.")
    ],
    only: Annotated[
        list[CheckName] | None, typer.Option("--only", help="Run only this check; repeat for more.")
    ] = None,
    incident: Annotated[
        str | None, typer.Option(help="Keep each check's output as evidence on this incident.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of a table.")] = False,
    policy: PolicyOption = None,
) -> None:
    """GPU count and NVLink links against the node's shape, DCGM at the policy's level, and an
    all-reduce across the nodes judged against the shape's bandwidth floor. Exit status: 0 every
    check passed, 1 a check failed, 3 a check gave no verdict, 2 a usage or configuration error."""
    from medic.apps.cli.prefect_run import run_flows
    from medic.flows.deep_check import deep_check

    rt = runtime_or_exit(policy)
    if incident is not None and rt.store.get_incident(incident) is None:
        raise _usage(f"no incident {incident} in the store")
    loaded = rt.policy()
    nodes = list(dict.fromkeys(nodes))
    wanted = set(only or CHECK_ORDER)
    unshaped = [n for n in nodes if loaded.policy.deep_checks.shape_of(n) is None]
    if unshaped and wanted & SHAPED:
        raise _usage(
            f"no shape for {', '.join(unshaped)}: add a pattern matching it to deep_checks.nodes in {loaded.path}"
        )
    report = run_flows(deep_check(nodes, incident, sorted(wanted, key=CHECK_ORDER.index)))
    if as_json:
        out: dict[str, Any] = {
            "schema_version": 1,
            "nodes": report.nodes,
            "incident": report.incident,
            "policy": {"path": loaded.path, "sha256": loaded.sha256},
            "dcgm_level": report.dcgm_level,
            "verdict": report.verdict.value,
            "checks": [r.model_dump(mode="json") for r in report.results],
        }
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        table = Table(title=f"Deep check of {', '.join(nodes)}", title_justify="left")
        for column in ("check", "nodes", "verdict", "reason"):
            table.add_column(column, overflow="fold")
        for r in report.results:
            verdict = f"[{STYLE[r.verdict]}]{r.verdict.value}[/]"
            table.add_row(r.check.value, escape(", ".join(r.nodes)), verdict, escape(r.reason))
        console.print(table)
        kept = f"; evidence kept on incident {incident}" if incident else ""
        console.print(f"Verdict: [bold]{report.verdict.value.upper()}[/bold]{kept}")
    raise typer.Exit(EXIT[report.verdict])
