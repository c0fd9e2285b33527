"""`medic advise ...`: sizing advice computed from a few numbers (docs/checkpoints.md)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Annotated

import typer
from rich.table import Table

from medic import advise
from medic.apps.cli._common import console

advise_app = typer.Typer(help="Advice computed from a few numbers, no cluster needed.", no_args_is_help=True)


@advise_app.callback()
def advise_group() -> None:
    """Advice computed from a few numbers, no cluster needed."""


@advise_app.command()
def checkpoint(
    save_seconds: Annotated[float, typer.Option(help="Seconds one checkpoint save blocks training.")],
    gpus: Annotated[int, typer.Option(help="GPUs the job runs on.", min=1)],
    gpu_mtbf_hours: Annotated[
        float | None, typer.Option(help="Mean time between failures of ONE GPU (its node included).")
    ] = None,
    job_mtbf_hours: Annotated[
        float | None, typer.Option(help="Mean time between failures of the whole job, if known.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """The checkpoint interval that loses the least time: Young's sqrt(2 * save * job MTBF)."""
    if (gpu_mtbf_hours is None) == (job_mtbf_hours is None):
        raise typer.BadParameter("give exactly one of --gpu-mtbf-hours and --job-mtbf-hours")
    try:
        mtbf = advise.job_mtbf_hours(gpu_mtbf_hours, gpus) if gpu_mtbf_hours is not None else job_mtbf_hours
        assert mtbf is not None  # exactly one of the two was given, checked above
        advice = advise.advise_checkpoint(save_seconds, mtbf)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    if as_json:
        sys.stdout.write(json.dumps({**asdict(advice), "gpus": gpus, "overhead": advice.overhead}) + "\n")
        return
    table = Table(title=f"Checkpointing a {gpus:,}-GPU job", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("job MTBF", advise.human_seconds(advice.job_mtbf_seconds))
    table.add_row("save", advise.human_seconds(advice.save_seconds))
    table.add_row("checkpoint every", advise.human_seconds(advice.interval_seconds))
    table.add_row("time saving", f"{advice.save_overhead:.2%}")
    table.add_row("work redone after failures", f"{advice.rework_overhead:.2%}")
    table.add_row("total overhead", f"{advice.overhead:.2%}")
    console.print(table)
