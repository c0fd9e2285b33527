"""`medic report`: the post-mortem over a window of incidents (docs/report.md): a terminal summary,
JSON, one CSV per table, or one HTML page with charts."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.columns import Columns
from rich.table import Table

from medic.apps.cli import report_views as views
from medic.apps.cli._common import console, err, parse_since
from medic.apps.cli.report_html import report_page
from medic.config import load_settings
from medic.report import Report, build_report, csv_tables
from medic.store import Store, utcnow


def report(
    since: Annotated[
        str, typer.Option(help="Incidents opened since: RFC 3339 time or a span (30m, 6h, 7d).")
    ] = "7d",
    html: Annotated[
        Path | None, typer.Option(help="Write one HTML page with charts to this file.", dir_okay=False)
    ] = None,
    csv_dir: Annotated[
        Path | None, typer.Option("--csv", help="Write one CSV per table into this folder.", file_okay=False)
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of tables.")] = False,
) -> None:
    """Post-mortem: incidents by class, action and rule, MTTR, time to first action, the nodes and
    GPUs with the most incidents, goodput lost per job, approvals and who gave them."""
    started = parse_since(since)
    built = build_report(
        Store(load_settings().database_url).report_rows(started), since=started, now=utcnow()
    )
    if html is not None:
        page, missing = report_page(built)
        html.write_text(page, encoding="utf-8")
        if missing:
            err.print(f"warning: {html} has no charts: {missing}", markup=False, highlight=False)
        err.print(f"wrote {html}", markup=False, highlight=False)
    if csv_dir is not None:
        for path in write_csv(csv_dir, built):
            err.print(f"wrote {path}", markup=False, highlight=False)
    if as_json:
        sys.stdout.write(built.model_dump_json(indent=2) + "\n")
        return
    _print(built)


def write_csv(directory: Path, built: Report) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, (headers, rows) in csv_tables(built).items():
        path = directory / f"{stem}.csv"
        with path.open("w", newline="", encoding="utf-8") as out:
            writer = csv.writer(out)
            writer.writerow(headers)
            writer.writerows(rows)
        written.append(path)
    return written


def _table(view: views.View) -> Table:
    table = Table(title=view.title, title_justify="left")
    for i, header in enumerate(view.headers):
        table.add_column(header, justify="right" if i in view.numeric else "left")
    for row in view.rows:
        table.add_row(*row)
    return table


def _print(built: Report) -> None:
    console.print(f"[bold]{len(built.incidents)} incidents, {views.window(built)}[/bold]")
    console.print(Columns([_table(v) for v in views.counts(built)]))
    console.print(_table(views.durations(built)))
    console.print(_table(views.histograms(built)))
    console.print(Columns([_table(views.nodes(built)), _table(views.gpus(built))]))
    console.print(_table(views.goodput(built)))
    console.print(Columns([_table(views.approvals(built)), _table(views.approvers(built))]))
    console.print(_table(views.held(built)))
