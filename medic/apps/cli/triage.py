"""`medic triage` and `medic schema`: events in, decisions out, nothing done (`medic ingest` acts).

Nothing here loads the store, the backends or Prefect: a triage of a million events holds little
more than the events in reach of its windows (BENCHMARKS.md, section 2a).
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import Progress, TextColumn
from rich.table import Table
from rich.text import Text

from medic.apps.cli import render
from medic.apps.cli._common import (
    EventsArgument,
    PolicyOption,
    console,
    err,
    load_policy_or_exit,
    report_rejections,
)
from medic.apps.cli.triage_parallel import ForkedReader, ReadingFailed, reader_for
from medic.events import FaultEvent
from medic.intake import Intake
from medic.intake import read_file as read_all
from medic.policy import groups
from medic.policy.selectors import OTHER_NODES
from medic.triage import EventReader, OutOfOrder, Replayed, replay, stream, triage_line


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
        reader = reader_for(events)
    except OSError as error:
        err.print(
            f"[red]error:[/red] cannot read {escape(str(events))}: {escape(error.strerror or str(error))}"
        )
        raise typer.Exit(2) from None
    # Nothing is printed before the whole file is read: a file out of time order is triaged
    # again in memory, and its output must be the same as if that had been done at once.
    rows: list[tuple[str | Text, ...]] = []  # the table's, when not --json: a few strings an incident
    with reader, tempfile.TemporaryFile("w+", encoding="utf-8") as spool:

        def take(result: Replayed) -> None:
            if as_json:
                spool.write(triage_line(result).model_dump_json() + "\n")
            else:
                rows.append(_row(result))

        try:
            read = reader.events(lambda rejection: report_rejections(Intake(rejected=[rejection])))
            with young_collections_only():
                for result in stream(_with_progress(read, reader, events.stat().st_size), loaded, fleet_size):
                    take(result)
            duplicates = reader.duplicates
        except ReadingFailed as error:
            err.print(f"[red]error:[/red] {escape(str(error))}")
            raise typer.Exit(2) from None
        except OutOfOrder:
            read.close()  # a reading process stops now, not when this frame ends
            spool.seek(0)
            spool.truncate()
            rows.clear()
            intake = read_all(events)
            report_rejections(Intake(rejected=intake.rejected[reader.rejected :]))
            duplicates = intake.duplicates
            for result in replay(intake.events, loaded, fleet_size):
                take(result)
        report_rejections(Intake(duplicates=duplicates))
        if as_json:
            spool.seek(0)
            shutil.copyfileobj(spool, sys.stdout)
            return
    table = Table(title=f"Triage with {loaded.path} ({loaded.sha256[:12]})", title_justify="left")
    columns = ("incident", "nodes", "events", "group", "class", "action", "level", "rule", "reason")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _row(result: Replayed) -> tuple[str | Text, ...]:
    incident, decision, placement = result.incident, result.decision, result.placement
    action = render.action_text(decision.action.value)
    if groups.observed(decision):  # as the live path tells the owner: nothing would be done
        action = Text.assemble("would have: ", action)
    return (
        incident.id,
        ", ".join(incident.nodes),
        str(len(incident.events)),
        _group_cell(placement),
        decision.classification.value,
        action,
        str(decision.diagnose_level or ""),
        decision.rule,
        decision.reason,
    )


def _group_cell(placement: groups.Placement) -> str | Text:
    """The node's group and mode; `undecidable` in red when no group could be told (the reason says why)."""
    if placement.problem is not None:
        return Text.assemble(("undecidable", "red"), f" ({placement.mode.value})")
    return f"{placement.group_name or OTHER_NODES} ({placement.mode.value})"


@contextmanager
def young_collections_only() -> Iterator[None]:
    """The cyclic collector without its full collections while a file streams through.

    A stream keeps hundreds of thousands of objects alive for a while (the windows' events, the
    context, the ids seen): each full collection walks all of them, and they came to a third of
    the time of a million-event triage while finding nothing to free (BENCHMARKS.md, section 2a).
    Young objects are still collected: a cycle made while deciding is freed as before, and
    everything else is freed by its reference count when the stream lets it go."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, NEVER)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, old)


NEVER = 2**30  # full collections asked for: more than a stream of any size makes


PROGRESS_EVERY = 4096  # events between two updates of the bar: drawing it costs more than an event


def _with_progress(
    events: Iterator[FaultEvent], reader: EventReader | ForkedReader, size: int
) -> Iterator[FaultEvent]:
    """`events`, with a progress bar on standard error when that is a terminal."""
    if not err.is_terminal:
        yield from events
        return
    columns = (*Progress.get_default_columns(), TextColumn("{task.fields[events]:,} events"))
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("triage", total=size, events=0)
        for count, event in enumerate(events, start=1):
            if count % PROGRESS_EVERY == 0:
                progress.update(task, completed=reader.chars, events=count)
            yield event


def schema() -> None:
    """Print the fault-event JSON Schema (docs/events.md)."""
    sys.stdout.write(json.dumps(FaultEvent.model_json_schema(), indent=2) + "\n")
