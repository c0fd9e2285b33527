"""`medic report --html FILE`: the report as one self-contained HTML page (docs/report.md).

The charts are PNGs drawn with matplotlib (the `plot` extra, as for `medic simulate --plot`) and
inlined as base64, so the page can be mailed or attached to a ticket as it is. Without
matplotlib the page is still written, with its tables and a note where each chart would be.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from html import escape
from typing import Any

from medic.apps.cli import report_views as views
from medic.apps.cli.report_views import TOP, View, duration, value
from medic.apps.cli.simulate_plots import PlottingUnavailable, figure_class
from medic.report import Report

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 72rem; color: #222; }
h1 { margin-bottom: 0.2rem; } .window { color: #666; margin-top: 0; }
section { margin-top: 2.2rem; } img { max-width: 100%; }
table { border-collapse: collapse; margin: 0.6rem 1.5rem 0.6rem 0; font-size: 0.9rem; }
caption { text-align: left; font-weight: 600; padding-bottom: 0.3rem; }
th, td { border-bottom: 1px solid #ddd; padding: 0.25rem 0.7rem; text-align: left; white-space: nowrap; }
.n { text-align: right; font-variant-numeric: tabular-nums; }
.tables { display: flex; flex-wrap: wrap; align-items: flex-start; }
.figures { display: flex; flex-wrap: wrap; gap: 1rem 2.5rem; }
.figure { font-size: 1.5rem; } .figure small { display: block; font-size: 0.8rem; color: #666; }
.note { color: #a33; }
"""


def report_page(report: Report) -> tuple[str, str | None]:
    """The page, and why its charts were left out (None when they are in it)."""
    try:
        charts, missing = _charts(report), None
    except PlottingUnavailable as error:
        charts, missing = {}, str(error)

    def chart(name: str, *instead: View) -> str:
        """The chart, or why it is missing and the tables that hold what it would have shown."""
        if name in charts:
            return f'<img alt="{name} chart" src="data:image/png;base64,{charts[name]}">'
        return f'<p class="note">Chart left out: {escape(missing or "")}</p>' + html_tables(*instead)

    sections = [
        ("Summary", "summary", _summary(report)),
        (
            "Incidents by classification, action and rule",
            "counts",
            chart("counts") + html_tables(*views.counts(report)),
        ),
        (
            "Time to repair and to first action",
            "durations",
            chart("durations", views.histograms(report)) + html_tables(views.durations(report)),
        ),
        (
            "Nodes and GPUs with the most incidents",
            "nodes",
            chart("nodes") + html_tables(views.nodes(report), views.gpus(report)),
        ),
        ("Goodput lost per job", "goodput", chart("goodput") + html_tables(views.goodput(report))),
        ("Approvals", "approvals", html_tables(views.approvals(report), views.approvers(report))),
        ("Nodes held", "held", html_tables(views.held(report))),
        ("Incidents", "incidents", html_tables(views.incidents(report))),
    ]
    body = "".join(
        f'<section id="{anchor}"><h2>{escape(title)}</h2>{html}</section>\n'
        for title, anchor, html in sections
    )
    page = f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>GPU Medic incident report</title><style>{STYLE}</style></head>
<body>
<h1>GPU Medic incident report</h1>
<p class="window">Incidents {escape(views.window(report))}; generated {views.when(report.generated_at)} UTC</p>
{body}</body>
</html>
"""
    return page, missing


def html_tables(*tables: View) -> str:
    return f'<div class="tables">{"".join(_table(t) for t in tables)}</div>'


def _table(view: View) -> str:
    def cells(tag: str, row: list[str]) -> str:
        return "".join(
            f'<{tag} class="n">{escape(c)}</{tag}>' if i in view.numeric else f"<{tag}>{escape(c)}</{tag}>"
            for i, c in enumerate(row)
        )

    body = "".join(f"<tr>{cells('td', row)}</tr>" for row in view.rows)
    return (
        f"<table><caption>{escape(view.title)}</caption>"
        f"<thead><tr>{cells('th', view.headers)}</tr></thead><tbody>{body}</tbody></table>"
    )


def _summary(report: Report) -> str:
    statuses = ", ".join(f"{c.incidents} {value(c)}" for c in report.by_status) or "none"
    answered = sum(a.answer in ("approved", "denied") for a in report.approvals)
    first_action = report.time_to_first_action
    figures = [
        (str(len(report.incidents)), f"incidents: {statuses}"),
        (duration(report.mttr.p50_s), f"MTTR p50; p90 {duration(report.mttr.p90_s)}"),
        (duration(first_action.p50_s), f"time to first action p50; p90 {duration(first_action.p90_s)}"),
        (
            duration(sum(j.downtime_s for j in report.goodput_lost)),
            f"job downtime over {len(report.goodput_lost)} jobs",
        ),
        (str(len(report.approvals)), f"approvals asked; {answered} answered"),
    ]
    cells = "".join(
        f'<div class="figure">{escape(number)}<small>{escape(meaning)}</small></div>'
        for number, meaning in figures
    )
    return f'<div class="figures">{cells}</div>'


# --- charts -------------------------------------------------------------------------------------


def _charts(report: Report) -> dict[str, str]:
    """Each chart as base64 PNG, by name. Raises PlottingUnavailable without matplotlib."""
    Figure = figure_class()
    jobs = max(1, len(report.goodput_lost))
    drawers: dict[str, tuple[tuple[float, float], int, Callable[[list[Any], Report], None]]] = {
        "counts": ((13, 3.6), 3, _draw_counts),
        "durations": ((12, 3.6), 2, _draw_durations),
        "nodes": ((12, 3.6), 2, _draw_nodes),
        "goodput": ((9, 1.4 + 0.45 * jobs), 1, _draw_goodput),
    }
    charts = {}
    for name, (size, panels, draw) in drawers.items():
        drawn = Figure(figsize=size, layout="constrained")
        draw(list(drawn.subplots(1, panels, squeeze=False)[0]), report)
        buffer = io.BytesIO()
        drawn.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
        charts[name] = base64.b64encode(buffer.getvalue()).decode("ascii")
    return charts


def _barh(ax: Any, labels: list[str], numbers: list[int], title: str) -> None:
    ax.barh(labels, numbers, color="#4c72b0")
    ax.invert_yaxis()  # the most first
    ax.set_title(title)
    ax.set_xlabel("incidents")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(axis="x", alpha=0.3)


def _draw_counts(axes: list[Any], report: Report) -> None:
    panels = [
        ("by classification", report.by_classification),
        ("by action", report.by_action),
        (f"by rule (top {TOP})", report.by_rule[:TOP]),
    ]
    for ax, (title, counts) in zip(axes, panels, strict=True):
        _barh(ax, [value(c) for c in counts], [c.incidents for c in counts], title)


def _draw_durations(axes: list[Any], report: Report) -> None:
    for ax, (name, d) in zip(axes, views.measures(report), strict=True):
        ax.bar([views.bin_label(b) for b in d.histogram], [b.incidents for b in d.histogram], color="#55a868")
        ax.set_title(f"{name}: p50 {duration(d.p50_s)}, p90 {duration(d.p90_s)}")
        ax.set_ylabel("incidents")
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.tick_params(axis="x", labelrotation=60, labelsize=8)
        ax.grid(axis="y", alpha=0.3)


def _draw_nodes(axes: list[Any], report: Report) -> None:
    nodes, gpus = report.nodes[:TOP], report.gpus[:TOP]
    _barh(axes[0], [n.node for n in nodes], [n.incidents for n in nodes], f"nodes (top {TOP})")
    _barh(axes[1], [f"{g.node} GPU {g.gpu}" for g in gpus], [g.incidents for g in gpus], f"GPUs (top {TOP})")


def _draw_goodput(axes: list[Any], report: Report) -> None:
    ax, jobs = axes[0], report.goodput_lost
    longest = max((j.downtime_s + j.lost_work_s for j in jobs), default=0.0)
    unit, scale = ("hours", 3600) if longest > 2 * 3600 else ("minutes", 60)
    left = [0.0] * len(jobs)
    parts = (
        ("detection", "detection_s", "#c44e52"),
        ("recovery", "recovery_s", "#dd8452"),
        ("lost work", "lost_work_s", "#8172b3"),
    )
    for label, key, color in parts:
        widths = [getattr(j, key) / scale for j in jobs]
        ax.barh([j.job for j in jobs], widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title("downtime (detection + recovery) and lost work, per job")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right")
