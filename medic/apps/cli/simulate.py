"""`medic simulate`: a simulated fleet running one training job, remediated by a policy (docs/simulate.md)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import replace
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from medic.advise import human_seconds
from medic.apps.cli._common import PolicyOption, console, err, load_policy_or_exit
from medic.whatif import fleetsim
from medic.whatif.fleetsim import BADPUT, Report, SimParams, fast_checkpointer, measured, meta_like_recovery
from medic.whatif.fleetsim.measurement import MeasurementError


class Recovery(StrEnum):
    MEASURED = "measured"  # measured end to end on a real Slurm cluster (medic/data/recovery-measured.json)
    MEDIC = "medic"  # SimParams' assumed durations
    FAST_CHECKPOINTER = "fast-checkpointer"
    META_LIKE = "meta-like"


PRESETS: dict[Recovery, Callable[[SimParams], SimParams]] = {
    Recovery.MEASURED: measured,
    Recovery.MEDIC: lambda p: p,
    Recovery.FAST_CHECKPOINTER: fast_checkpointer,
    Recovery.META_LIKE: meta_like_recovery,
}
MTBF_SIZES = (1_000, 10_000, 100_000, 1_000_000)


def simulate(
    gpus: Annotated[int, typer.Option(help="GPUs the job runs on.", min=8)] = 16_384,
    days: Annotated[float, typer.Option(help="Days simulated.", min=0.01)] = 54.0,
    policy: PolicyOption = None,
    compare: Annotated[
        Path | None,
        typer.Option(help="A second policy, run on the same faults.", exists=True, dir_okay=False),
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed: the same seed gives the same report.")] = 1,
    recovery: Annotated[
        Recovery,
        typer.Option(
            help="Durations: measured on real Slurm, assumed (GPU Medic's), a fast checkpointer's, or Meta-like."
        ),
    ] = Recovery.MEASURED,
    spares: Annotated[int | None, typer.Option(help="Idle nodes the job can restart on.", min=0)] = None,
    save_seconds: Annotated[
        float | None, typer.Option(help="Seconds one checkpoint save blocks training.", min=0.001)
    ] = None,
    gpu_mtbf_hours: Annotated[
        float | None, typer.Option(help="Mean time between failures of one GPU (its node included).", min=1)
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write PNG charts into this folder.", file_okay=False)
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """Simulate a fleet's faults and remediation: goodput, badput by cause, people, spares."""
    try:
        params = PRESETS[recovery](SimParams(gpus=gpus, days=days))
    except MeasurementError as error:  # the shipped measurement is broken: say which file and field
        err.print(f"error: {error}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    params = replace(
        params,
        spare_nodes=params.spare_nodes if spares is None else spares,
        checkpoint_save_s=params.checkpoint_save_s if save_seconds is None else save_seconds,
        gpu_mtbf_hours=params.gpu_mtbf_hours if gpu_mtbf_hours is None else gpu_mtbf_hours,
    )
    policies = [load_policy_or_exit(policy)] + ([load_policy_or_exit(compare)] if compare else [])
    try:
        reports = [fleetsim.simulate(params, loaded, seed) for loaded in policies]
    except ValueError as error:  # a save too slow for the fleet's MTBF
        raise typer.BadParameter(str(error)) from None
    if plot is not None:
        from medic.apps.cli.simulate_plots import PlottingUnavailable, write_plots

        try:
            written = write_plots(plot, reports, fleetsim.mtbf_by_size(params, policies[0], seed, MTBF_SIZES))
        except PlottingUnavailable as error:
            err.print(f"error: {error}", markup=False, highlight=False)
            raise typer.Exit(2) from None
        for path in written:
            err.print(f"wrote {path}", markup=False, highlight=False)
    if as_json:
        sys.stdout.write(json.dumps({"runs": [r.to_dict() for r in reports]}, indent=2) + "\n")
        return
    _print(reports, params, recovery)


def _badput(key: str, report: Report) -> str:
    seconds = report.badput_s[key]
    return f"{seconds / report.wall_s:.2%} ({seconds / 3600:,.1f} h)"


def _print(reports: list[Report], params: SimParams, recovery: Recovery) -> None:
    first = reports[0]
    table = Table(
        title=f"{params.gpus:,} GPUs for {params.days:g} days, seed {first.seed}, {recovery.value} durations",
        title_justify="left",
    )
    table.add_column("")
    for report in reports:
        table.add_column(Path(report.policy).name, justify="right")

    def row(label: str, cell: Callable[[Report], object]) -> None:
        table.add_row(label, *(str(cell(r)) for r in reports))

    row("effective training time (goodput)", lambda r: f"[bold]{r.goodput:.2%}[/bold]")
    row("interruptions (faults + repeats)", lambda r: f"{r.interruptions} ({r.faults} + {r.repeats})")
    row("time between interruptions", lambda r: human_seconds(r.observed_mtbf_s))
    row("checkpoint every", lambda r: human_seconds(r.checkpoint_interval_s))
    for key, meaning in BADPUT.items():
        row(f"badput: {meaning}", partial(_badput, key))
    row("dominant badput", lambda r: BADPUT[r.dominant_badput])
    row("human interventions", lambda r: r.human_interventions)
    row("approvals asked", lambda r: r.approvals)
    row("nodes replaced", lambda r: r.nodes_replaced)
    row("of them not at fault", lambda r: r.false_replacements)
    row("incidents decided by the engine", lambda r: f"{r.decided} shapes, {r.asked} decisions")
    console.print(table)
