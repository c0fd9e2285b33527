"""`medic rollout report --html FILE`: the rollout report as one self-contained page (docs/rollout.md#html).

Unlike `medic report`'s page, the charts are inline SVG drawn here: a few bars and points need no
matplotlib, so the page is whole on every install, and it loads nothing (no script, no stylesheet, no
font from elsewhere). The layout and tables are `medic report`'s (medic/apps/cli/report_html.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from html import escape
from itertools import pairwise

from medic.apps.cli.report_html import STYLE, html_tables
from medic.apps.cli.report_views import View, when
from medic.rollout import Group, Pair, RolloutReport

# The group's counts as the page shows them, each by its key in the JSON report.
COUNTS = (
    ("would_have", "would-have decisions"),
    ("agreed", "agreed: people did the same kind of action"),
    ("disagreed", "disagreed: people did something else"),
    ("missed_by_people", "GPU Medic acted, people did nothing, the node failed again: people's miss"),
    ("false_alarm", "GPU Medic acted, people did nothing, the node did not fail again: a false alarm"),
    ("pending", "GPU Medic acted, people did nothing: too early to tell"),
    ("our_misses", "people acted, GPU Medic saw nothing: our miss"),
    ("destructive_disagreements", "destructive disagreements"),
)
# Minutes saved per agreed decision, binned: from a quick answer by people to one after the window.
SAVED_EDGES = (0, 15, 30, 60, 120, 240, 480)
RIGHT = ("agreed", "missed_by_people")  # the verdicts agreement counts as borne out

PAGE_STYLE = (
    STYLE
    + """
.ready { color: #1a7f37; font-weight: 600; } .not-ready { color: #a33; font-weight: 600; }
h2 small { font-weight: normal; color: #666; font-size: 0.9rem; }
figure.plot { margin: 1rem 0; } svg text { font: 11px system-ui, sans-serif; fill: #333; }
"""
)
# The outcomes plotted, by their key in the JSON report, with a short label and a colour each.
OUTCOMES = (
    ("agreed", "agreed", "#55a868"),
    ("disagreed", "disagreed", "#c44e52"),
    ("missed_by_people", "people's miss", "#8172b3"),
    ("false_alarm", "false alarm", "#dd8452"),
    ("pending", "pending", "#999999"),
    ("our_misses", "our miss", "#4c72b0"),
)


def rollout_page(report: RolloutReport) -> str:
    span = f"since {when(report.since)} UTC" if report.since else "all time"
    body = (
        "".join(_section(g) for g in report.groups)
        or "<p>No decisions on nodes and no actions by people.</p>"
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>GPU Medic rollout report</title><style>{PAGE_STYLE}</style></head>
<body>
<h1>GPU Medic rollout report</h1>
<p class="window">Decisions {escape(span)}; window {report.window_hours:g} h, recurrence
{report.recurrence_days:g} d; generated {when(report.generated_at)} UTC</p>
{body}</body>
</html>
"""


def _section(g: Group) -> str:
    history = ", ".join(f"{m.mode} {m.decisions}" for m in g.modes) or "no decisions"
    if g.readiness.ready:
        verdict = '<p class="ready">Ready: every threshold holds.</p>'
    else:
        verdict = f'<p class="not-ready">Not ready: {escape("; ".join(g.readiness.reasons))}.</p>'
    return (
        f'<section class="group" data-group="{escape(g.name)}">'
        f"<h2>group {escape(g.name)} <small>mode now: {escape(g.mode_now or 'unknown')}; "
        f"decisions by mode: {escape(history)}</small></h2>{verdict}"
        f'<figure class="plot" data-group="{escape(g.name)}">{_plot(g)}</figure>'
        + html_tables(_counts(g), _thresholds(g))
        + html_tables(_pairs(g), _missed(g))
        + "</section>\n"
    )


def _counts(g: Group) -> View:
    rows = [[label, str(getattr(g, key))] for key, label in COUNTS]
    median = "-" if g.saved_minutes_median is None else f"{g.saved_minutes_median:.0f}"
    rows += [["minutes saved: median", median], ["minutes saved: total", f"{g.saved_minutes_total:.0f}"]]
    return View("Counts", ["", "n"], rows, frozenset({1}))


def _thresholds(g: Group) -> View:
    shown = "-" if g.readiness.agreement is None else f"{g.readiness.agreement:.1%}"
    t = g.thresholds
    return View(
        "Readiness",
        ["", "bar", "now"],
        [
            ["would-have decisions, at least", f"{t['decisions']:g}", str(g.would_have)],
            ["agreement, at least", f"{t['agreement']:.0%}", shown],
            [
                "destructive disagreements, at most",
                f"{t['destructive_disagreements']:g}",
                str(g.destructive_disagreements),
            ],
        ],
        frozenset({1, 2}),
    )


def _pairs(g: Group) -> View:
    return View(
        "Would-have decisions beside what people did",
        ["decided", "node", "action", "rule", "verdict", "people", "at", "minutes saved"],
        [
            [
                when(p.decided_at),
                p.node,
                p.action,
                p.rule,
                p.verdict,
                p.people_change or "-",
                when(p.people_at),
                "-" if p.saved_minutes is None else f"{p.saved_minutes:.0f}",
            ]
            for p in g.pairs
        ],
        frozenset({7}),
    )


def _missed(g: Group) -> View:
    why = {u.event: u.why for u in g.unplaced}
    return View(
        "Our misses (people's actions GPU Medic saw nothing before)",
        ["event", "not placed in a group because"],
        [[event, why.get(event, "")] for event in g.missed],
    )


# --- the plot: three panels side by side in one SVG -----------------------------------------------

WIDTH, HEIGHT, PANEL = 960, 230, 300  # the SVG, and each panel's width
TOP, BOTTOM = 28, 48  # room for a panel's title and its axis labels


@dataclass(frozen=True, slots=True)
class Bar:
    label: str
    value: float
    color: str = "#4c72b0"


def _plot(g: Group) -> str:
    outcomes = [Bar(label, getattr(g, key), color) for key, label, color in OUTCOMES]
    daily = _daily(g.pairs)
    panels = [
        _bars(0, "What happened", outcomes),
        _agreement(PANEL + 30, daily, g.thresholds["agreement"]),
        _bars(2 * (PANEL + 30), "Minutes saved per agreed decision", _saved(g.pairs)),
    ]
    return (
        f'<svg role="img" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">'
        f"<title>group {escape(g.name)}: outcomes, agreement per day, minutes saved</title>"
        + "".join(panels)
        + "</svg>"
    )


def _bars(x0: int, title: str, bars: list[Bar]) -> str:
    """Horizontal bars, labelled on the left, each with its value at its end."""
    top = max((b.value for b in bars), default=0) or 1
    label_w, value_w = 92, 28
    step = (HEIGHT - TOP - 8) / max(len(bars), 1)
    room = PANEL - label_w - value_w
    parts = [f'<text x="{x0}" y="14" font-weight="600">{escape(title)}</text>']
    for i, b in enumerate(bars):
        y = TOP + i * step
        w = room * b.value / top
        parts.append(
            f'<text x="{x0 + label_w - 6}" y="{y + step * 0.62:.1f}" text-anchor="end">{escape(b.label)}</text>'
            f'<rect x="{x0 + label_w}" y="{y + step * 0.15:.1f}" width="{w:.1f}" height="{step * 0.7:.1f}" '
            f'fill="{b.color}"><title>{escape(b.label)}: {b.value:g}</title></rect>'
            f'<text x="{x0 + label_w + w + 4:.1f}" y="{y + step * 0.62:.1f}">{b.value:g}</text>'
        )
    return "".join(parts)


def _daily(pairs: list[Pair]) -> list[tuple[str, float, int]]:
    """Per day with a judged would-have decision: the day, its agreement, how many were judged."""
    by_day: defaultdict[str, list[bool]] = defaultdict(list)
    for p in pairs:
        if p.verdict != "pending":
            by_day[f"{p.decided_at:%Y-%m-%d}"].append(p.verdict in RIGHT)
    return [(day, sum(right) / len(right), len(right)) for day, right in sorted(by_day.items())]


def _agreement(x0: int, daily: list[tuple[str, float, int]], bar: float) -> str:
    """Agreement per day as points joined by a line, 0 to 100%, with the policy's bar dashed."""
    height = HEIGHT - TOP - BOTTOM
    axis = 36  # the scale's labels, left of the plot
    left, width = x0 + axis, PANEL - axis
    parts = [
        f'<text x="{x0}" y="14" font-weight="600">Agreement per day</text>',
        f'<line x1="{left}" y1="{TOP + height}" x2="{x0 + PANEL}" y2="{TOP + height}" stroke="#999"/>',
        f'<line x1="{left}" y1="{TOP}" x2="{left}" y2="{TOP + height}" stroke="#999"/>',
        f'<line x1="{left}" y1="{TOP + height * (1 - bar):.1f}" x2="{x0 + PANEL}" '
        f'y2="{TOP + height * (1 - bar):.1f}" stroke="#a33" stroke-dasharray="4 3">'
        f"<title>readiness bar {bar:.0%}</title></line>",
        f'<text x="{left - 4}" y="{TOP + 4}" text-anchor="end">100%</text>'
        f'<text x="{left - 4}" y="{TOP + height}" text-anchor="end">0%</text>',
    ]
    if not daily:
        parts.append(f'<text x="{left + 20}" y="{TOP + height / 2}">no decision judged yet</text>')
        return "".join(parts)
    step = width / len(daily)
    points = [
        (left + step * (i + 0.5), TOP + height * (1 - share), day, share, n)
        for i, (day, share, n) in enumerate(daily)
    ]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y, *_ in points)
    parts.append(f'<polyline points="{line}" fill="none" stroke="#4c72b0"/>')
    for x, y, day, share, n in points:
        parts.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="#4c72b0">'
            f"<title>{day}: {share:.0%} of {n}</title></circle>"
        )
    ends = {0: daily[0][0], len(daily) - 1: daily[-1][0]}
    for i, day in ends.items():
        parts.append(
            f'<text x="{points[i][0]:.1f}" y="{TOP + height + 14}" text-anchor="middle">{day[5:]}</text>'
        )
    return "".join(parts)


def _saved(pairs: list[Pair]) -> list[Bar]:
    """Agreed decisions per bin of minutes saved (people answer after the decision: never negative)."""
    saved = [p.saved_minutes for p in pairs if p.saved_minutes is not None]
    edges = SAVED_EDGES
    bars = [
        Bar(f"{low}-{high} min", sum(low <= m < high for m in saved), "#55a868")
        for low, high in pairwise(edges)
    ]
    return [*bars, Bar(f"≥ {edges[-1]} min", sum(m >= edges[-1] for m in saved), "#55a868")]
