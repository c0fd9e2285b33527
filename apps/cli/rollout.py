"""`medic rollout report`: per node group, GPU Medic's decisions beside what people did to the same
nodes (docs/rollout.md#the-report), as text or JSON."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Annotated

import typer

from medic.apps.cli._common import console
from medic.apps.cli.incidents import _since
from medic.config import load_settings
from medic.rollout import Group, RolloutReport, Thresholds, build_rollout
from medic.store import Store, utcnow

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
    ] = 6.0,
    recurrence_days: Annotated[
        float,
        typer.Option(
            min=0.1, help="Days in which a node's next incident makes a would-have a miss by people."
        ),
    ] = 7.0,
    min_decisions: Annotated[int, typer.Option(min=0, help="Readiness: would-have decisions at least.")] = 50,
    min_agreement: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Readiness: agreement at least (0 to 1).")
    ] = 0.95,
    max_destructive: Annotated[
        int, typer.Option(min=0, help="Readiness: destructive disagreements at most.")
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of text.")] = False,
) -> None:
    """Per node group: agreed, disagreed, would have acted where people did nothing (missed by people or
    a false alarm), people acted where GPU Medic saw nothing, minutes saved, and a readiness line."""
    started = _since(since)
    window = timedelta(hours=window_hours)
    store = Store(load_settings().database_url)
    # From a window earlier: a change early in the span needs the decision or change just before it.
    rows = store.rollout_rows(None if started is None else started - window)
    built = build_rollout(
        rows.decisions,
        rows.people,
        rows.opened,
        modes_now=store.last_modes(),
        since=started,
        now=utcnow(),
        window=window,
        recurrence=timedelta(days=recurrence_days),
        thresholds=Thresholds(min_decisions, min_agreement, max_destructive),
        group=group,
    )
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
        f"  minutes saved: median {median}, total {g.saved_minutes_total:.0f}",
        f"  readiness: {verdict}",
    ]
