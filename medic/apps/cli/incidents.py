"""`medic incidents` and `medic incident`: what the store recorded."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from medic.apps.cli import render
from medic.apps.cli._common import console, err, parse_since
from medic.config import load_settings
from medic.store import Store

LEASE_FIELDS = frozenset({"runner", "lease_until"})


def incidents(
    node: Annotated[str | None, typer.Option(help="Incidents with any event on this node.")] = None,
    job: Annotated[str | None, typer.Option(help="Incidents with any event from this job.")] = None,
    owner: Annotated[str | None, typer.Option(help="Incidents of this job owner.")] = None,
    since: Annotated[str | None, typer.Option(help="RFC 3339 time or a span: 30m, 6h, 7d.")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Find incidents in the store: "which jobs did this node touch?", "everything for job J"."""
    store = Store(load_settings().database_url)
    rows = store.find_incidents(node=node, job=job, owner=owner, since=parse_since(since))
    if as_json:
        for row in rows:
            # The lease is which process runs the incident now: bookkeeping, not part of the rows'
            # documented contract (docs/cli.md). A set: pydantic's typing of `exclude` takes no frozenset.
            sys.stdout.write(row.model_dump_json(exclude=set(LEASE_FIELDS)) + "\n")
        return
    console.print(render.incidents_table(rows, title=f"{len(rows)} incidents"))


def incident(incident_id: str) -> None:
    """Everything the store recorded for one incident, step by step."""
    detail = Store(load_settings().database_url).incident_detail(incident_id)
    if detail is None:
        err.print(f"[red]no incident {incident_id}[/red]")
        raise typer.Exit(1)
    console.print(render.incident_view(detail))
