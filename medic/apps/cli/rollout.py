"""`medic rollout report`: per node group, GPU Medic's decisions beside what people did to the same
nodes (docs/rollout.md#the-report), as text or JSON, and as an HTML page."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Annotated

import typer

from medic.apps.cli._common import PolicyOption, console, err, load_policy_or_exit, parse_since
from medic.apps.cli.rollout_html import rollout_page
from medic.config import load_settings
from medic.rollout import Group, Override, RolloutReport
from medic.store import Store, utcnow
from medic.store.rollout import RECURRENCE, WINDOW

rollout_app = typer.Typer(
    help="Earn automatic mode: GPU Medic's decisions compared with what people did.", no_args_is_help=True
)


@rollout_app.command("report")
def rollout_report(
    group: Annotated[str | None, typer.Option(help="Only this node group (`*`: nodes in no group).")] = None,
    since: Annotated[
        str, typer.Option(help="Decisions made since: RFC 3339 time or a span (30m, 6h, 7d).")
    ] = "30d",
    window_hours: Annotated[
        float, typer.Option(min=0.1, help="Hours after a decision in which people's action is its answer.")
    ] = WINDOW.total_seconds() / 3600,
    recurrence_days: Annotated[
        float,
        typer.Option(
            min=0.1, help="Days in which a node's next incident makes a would-have a miss by people."
        ),
    ] = RECURRENCE.total_seconds() / 86400,
    min_decisions: Annotated[
        int | None,
        typer.Option(
            min=0, help="Readiness: would-have decisions at least (default: the policy's `readiness`)."
        ),
    ] = None,
    min_agreement: Annotated[
        float | None,
        typer.Option(min=0.0, max=1.0, help="Readiness: agreement at least, 0 to 1 (default: the policy's)."),
    ] = None,
    max_destructive: Annotated[
        int | None,
        typer.Option(min=0, help="Readiness: destructive disagreements at most (default: the policy's)."),
    ] = None,
    policy: PolicyOption = None,
    html: Annotated[
        Path | None,
        typer.Option(help="Also write one self-contained HTML page with a plot per group.", dir_okay=False),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of text.")] = False,
) -> None:
    """Per node group: agreed, disagreed, would have acted where people did nothing (missed by people or
    a false alarm), people acted where GPU Medic saw nothing, minutes saved, and a readiness line against
    the policy's thresholds (an option given wins over them, for every group)."""
    started = parse_since(since)
    loaded = load_policy_or_exit(policy)
    store = Store(load_settings().database_url)
    built = store.rollout_report(
        loaded.policy,
        since=started,
        now=utcnow(),
        window=timedelta(hours=window_hours),
        recurrence=timedelta(days=recurrence_days),
        override=Override(min_decisions, min_agreement, max_destructive),
        group=group,
    )
    if html is not None:
        html.write_text(rollout_page(built), encoding="utf-8")
        err.print(f"wrote {html}", markup=False, highlight=False)
    if as_json:
        sys.stdout.write(built.model_dump_json(indent=2) + "\n")
        return
    _print(built)


def _print(built: RolloutReport) -> None:
    span = f"since {built.since:%Y-%m-%d %H:%M} UTC" if built.since else "all time"
    console.print(
        f"Rollout report, {span}; window {built.window_hours:g} h, recurrence {built.recurrence_days:g} d",
        markup=False,
        highlight=False,
    )
    if not built.groups:
        console.print("no decisions on nodes and no actions by people", markup=False, highlight=False)
    for g in built.groups:
        for line in _lines(g):
            console.print(line, markup=False, highlight=False)


def _lines(g: Group) -> list[str]:
    history = ", ".join(f"{m.mode} {m.decisions}" for m in g.modes) or "no decisions"
    median = "-" if g.saved_minutes_median is None else f"{g.saved_minutes_median:.0f}"
    verdict = "ready" if g.readiness.ready else "not ready: " + "; ".join(g.readiness.reasons)
    return [
        "",
        f"group {g.name} (mode now: {g.mode_now or 'unknown'}; decisions by mode: {history})",
        f"  would have {g.would_have}: agreed {g.agreed}, disagreed {g.disagreed}, "
        f"missed by people {g.missed_by_people}, false alarm {g.false_alarm}, pending {g.pending}",
        f"  destructive disagreements {g.destructive_disagreements}; our misses {g.our_misses}",
        *(f"    not placed in a group: {u.why}" for u in g.unplaced),
        f"  minutes saved: median {median}, total {g.saved_minutes_total:.0f}",
        f"  readiness: {verdict}",
    ]
