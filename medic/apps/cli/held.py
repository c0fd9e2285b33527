"""`medic node held`: every node GPU Medic holds out of service, why, and what the scheduler says of it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from pydantic import TypeAdapter
from rich.markup import escape
from rich.table import Table

from medic.apps.cli._common import console, err
from medic.config import load_settings
from medic.holds import Hold, InScheduler, in_scheduler
from medic.protocols import NodeInfo


class HeldNode(Hold):
    """A hold as `--json` lists it: the store's record and the scheduler's view (docs/cli.md#medic-node-held)."""

    scheduler: InScheduler
    scheduler_reason: str | None = None  # the reason the scheduler shows for the node's state


def held_command(
    scheduler: Annotated[
        bool,
        typer.Option(
            "--scheduler/--no-scheduler",
            help="Ask the configured scheduler how it shows each node (--no-scheduler: the store alone).",
        ),
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="A JSON array, one object per node.")] = False,
    store_url: Annotated[
        str | None, typer.Option("--store", help="Store URL (default: $MEDIC_DATABASE_URL).")
    ] = None,
) -> None:
    """The nodes GPU Medic took out of service and has not returned: the incident that holds each, since
    when, its outcome (why), and whether the scheduler still shows the node drained for it. Exit status
    1 when the scheduler shows a held node returned, or taken, by someone else."""
    # Imported here: the node bundle lists this command without the store's packages.
    from medic.store import Store

    store = Store(store_url or load_settings().database_url)
    try:
        holds = store.held_nodes()
    finally:
        store.close()
    ask = _scheduler() if scheduler and holds else None
    nodes = [_view(hold, ask) for hold in holds]
    if as_json:
        sys.stdout.write(TypeAdapter(list[HeldNode]).dump_json(nodes, indent=2).decode() + "\n")
    else:
        _print(nodes)
    moved = {InScheduler.RETURNED, InScheduler.TAKEN}
    raise typer.Exit(1 if any(n.scheduler in moved for n in nodes) else 0)


def _scheduler() -> Callable[[str], NodeInfo] | None:
    from medic.integrations.registry import BackendError, from_settings

    try:
        return from_settings(load_settings()).scheduler.node
    except BackendError as error:  # no scheduler configured where this runs: the store's list alone
        err.print(f"[yellow]the scheduler was not asked: {escape(str(error))}[/yellow]")
        return None


def _view(hold: Hold, ask: Callable[[str], NodeInfo] | None) -> HeldNode:
    from medic.tasks.nodes.service import drain_incident

    info = None
    if ask is not None:
        try:
            info = ask(hold.node)
        except Exception as error:  # unreachable, or a node it does not know: unknown, never "held"
            err.print(f"[yellow]{escape(hold.node)}: {type(error).__name__}: {escape(str(error))}[/yellow]")
    return HeldNode(
        **hold.model_dump(),
        scheduler=in_scheduler(hold, info, drain_incident(info.reason if info else None)),
        scheduler_reason=info.reason if info else None,
    )


def _print(nodes: list[HeldNode]) -> None:
    if not nodes:
        console.print("GPU Medic holds no node out of service.")
        return
    now = datetime.now(UTC)
    table = Table(title=f"{len(nodes)} nodes held out of service by GPU Medic", title_justify="left")
    for column in ("node", "incident", "action", "held for", "incident status", "why", "scheduler"):
        table.add_column(column, overflow="fold")
    for n in nodes:
        table.add_row(
            escape(n.node),
            escape(n.incident),
            n.action,
            _span(now - n.since),
            n.incident_status or "not in this store",
            escape(n.outcome or ""),
            n.scheduler.value + (f" ({escape(n.scheduler_reason)})" if n.scheduler_reason else ""),
        )
    console.print(table)


def _span(held: timedelta) -> str:
    seconds = int(held.total_seconds())
    hours, rest = divmod(seconds, 3600)
    return f"{hours} h {rest // 60} min" if hours else f"{rest // 60} min {rest % 60} s"
