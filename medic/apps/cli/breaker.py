"""`medic breaker ...`: the circuit breaker's state in the store."""

from __future__ import annotations

from typing import Annotated

import typer

from medic.apps.cli._common import console
from medic.config import load_settings
from medic.store import Store

breaker_app = typer.Typer(
    help="The circuit breaker: opened by a storm, closed by a human.", no_args_is_help=True
)


@breaker_app.command("status")
def breaker_status() -> None:
    """Is the breaker open, since when, and why."""
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
    row = Store(load_settings().database_url).close_breaker(by)
    console.print(
        "it was not open" if row is None else f"closed by {by}; opened {row.opened_at:%Y-%m-%d %H:%M:%S}"
    )
