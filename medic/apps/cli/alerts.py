"""`medic alerts check`: the Alertmanager mapping a site adds (MEDIC_ALERT_MAP) checked before a restart,
every problem at its file:line:column, as `medic serve` would refuse it (docs/prometheus.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from medic.alerts import ALERT_MAP_ENV, load_alert_map, shipped_map
from medic.apps.cli._common import err
from medic.policy import PolicyError

alerts_app = typer.Typer(help="Check the Alertmanager mapping (POST /v1/alertmanager).", no_args_is_help=True)


@alerts_app.command("check")
def alerts_check(
    files: Annotated[
        list[Path] | None,
        typer.Argument(help=f"Site mapping files; none: the one {ALERT_MAP_ENV} names, or the shipped one."),
    ] = None,
) -> None:
    """Load each site mapping merged over the shipped one, as `medic serve` does; problems are printed as
    file:line:column: message, and the exit code is 1."""
    shipped = shipped_map()
    named = [str(f) for f in files or []] or [os.environ.get(ALERT_MAP_ENV, "").strip()]
    failed = False
    for path in named:
        try:
            merged = load_alert_map({ALERT_MAP_ENV: path})
        except PolicyError as error:
            failed = True
            for problem in error.problems:
                err.print(str(problem), markup=False, highlight=False)
            continue
        added = len(merged.fields) - len(shipped.fields), len(merged.alerts) - len(shipped.alerts)
        where = f"{path}: ok, merged over the shipped mapping" if path else "the shipped mapping: ok"
        typer.echo(
            f"{where} ({len(merged.fields)} fields, {added[0]} added; {len(merged.alerts)} alerts, "
            f"{added[1]} added; node from {', '.join(merged.node_labels)})"
        )
    if failed:
        raise typer.Exit(1)
