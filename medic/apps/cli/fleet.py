"""`medic fleet ...`: the fleet's hardware across incidents and jobs, from the store."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from medic.ageing import FleetHealth, assess
from medic.apps.cli._common import console, parse_since
from medic.config import load_settings
from medic.store import Store

fleet_app = typer.Typer(help="The fleet's hardware across incidents and jobs.", no_args_is_help=True)


@fleet_app.command("health")
def fleet_health(
    since: Annotated[
        str,
        typer.Option(help="Look at incidents and readings since: RFC 3339 time or a span (30m, 6h, 30d)."),
    ] = "30d",
    top: Annotated[int, typer.Option(min=1, help="List this many nodes, the likeliest to fail first.")] = 20,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON document (docs/fleet-health.md#json).")
    ] = False,
    store_url: Annotated[
        str | None, typer.Option("--store", help="Store URL (default: $MEDIC_DATABASE_URL).")
    ] = None,
) -> None:
    """Nodes ranked by how likely they are to fail next, with the evidence: incidents again and again
    on one GPU, across jobs and users, and error counters climbing (docs/fleet-health.md)."""
    until = datetime.now(UTC)
    start = parse_since(since) or until
    store = Store(store_url or load_settings().database_url)
    try:
        incidents = store.past_incidents(start, until)
        readings = store.counter_readings(start, until)
    finally:
        store.close()
    health = assess(incidents, readings, start, until, top)
    if as_json:
        sys.stdout.write(health.model_dump_json(indent=2) + "\n")
        return
    _print(health)


def _print(health: FleetHealth) -> None:
    window = f"since {health.since:%Y-%m-%d %H:%M} ({health.incidents} incidents counted)"
    if not health.nodes:
        console.print(f"No node shows evidence of ageing {window}.")
        return
    table = Table(
        title=f"{len(health.nodes)} of {health.nodes_scored} nodes with evidence of ageing, {window}",
        title_justify="left",
    )
    for column in ("rank", "node", "score", "incidents", "MTBI (h)", "GPUs (score)", "evidence (worst GPU)"):
        table.add_column(
            column, justify="right" if column in ("rank", "score", "incidents", "MTBI (h)") else "left"
        )
    for node in health.nodes:
        worst = node.gpus[0]
        table.add_row(
            str(node.rank),
            escape(node.node),
            f"{node.score:g}",
            str(node.incidents),
            "-" if node.mtbi_hours is None else f"{node.mtbi_hours:g}",
            ", ".join(f"{'node' if g.gpu is None else g.gpu} ({g.score:g})" for g in node.gpus),
            "\n".join(f"{e.points:+g} {escape(e.why)}" for e in worst.evidence),
        )
    console.print(table)
