"""The charts of `medic simulate --plot DIR`: PNG files drawn with matplotlib (the `plot` extra).

matplotlib is imported here only, when charts are asked for, so the rest of the CLI runs
without it. Figures are drawn on their own canvas (no pyplot, no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from medic.whatif.fleetsim import BADPUT, Report


class PlottingUnavailable(RuntimeError):
    """Raised when matplotlib is not installed."""


def figure_class() -> Any:
    """matplotlib's Figure, drawn on its own canvas (`medic report --html` draws with it too)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlottingUnavailable(
            "charts need matplotlib: pip install 'gpu-medic[plot]' (or pip install matplotlib)"
        ) from None
    return Figure


def write_plots(directory: Path, reports: list[Report], mtbf: list[tuple[int, float]]) -> list[Path]:
    """goodput.png, badput.png, mtbf.png and summary.png (the first two side by side) in `directory`."""
    Figure = figure_class()
    directory.mkdir(parents=True, exist_ok=True)
    first = reports[0]
    gpus = first.params["gpus"]
    written = []

    def save(figure: Any, name: str) -> None:
        path = directory / name
        figure.savefig(path, dpi=120, metadata={"Software": None})
        written.append(path)

    figure = Figure(figsize=(7, 4), layout="constrained")
    _goodput(figure.subplots(), reports, gpus)
    save(figure, "goodput.png")

    figure = Figure(figsize=(7, 4), layout="constrained")
    _badput(figure.subplots(), reports)
    save(figure, "badput.png")

    figure = Figure(figsize=(7, 4), layout="constrained")
    _mtbf(figure.subplots(), first, mtbf)
    save(figure, "mtbf.png")

    figure = Figure(figsize=(12, 4.2), layout="constrained")
    left, right = figure.subplots(1, 2)
    _goodput(left, reports, gpus)
    _badput(right, reports)
    save(figure, "summary.png")
    return written


def _label(report: Report) -> str:
    return f"{Path(report.policy).name} ({report.goodput:.1%})"


def _goodput(ax: Any, reports: list[Report], gpus: int) -> None:
    for report in reports:
        days = [hours / 24 for hours, _ in report.timeline]
        ax.step(days, [100 * g for _, g in report.timeline], where="post", label=_label(report))
    ax.set_title(f"Effective training time so far, {gpus:,} GPUs")
    ax.set_xlabel("day")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(top=100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


def _badput(ax: Any, reports: list[Report]) -> None:
    causes = list(BADPUT)
    height = 0.8 / len(reports)
    for i, report in enumerate(reports):
        fractions = report.badput_fraction
        ax.barh(
            [c + i * height for c in range(len(causes))],
            [100 * fractions[k] for k in causes],
            height=height,
            label=_label(report),
        )
    ax.set_yticks(
        [c + height * (len(reports) - 1) / 2 for c in range(len(causes))], [BADPUT[k] for k in causes]
    )
    ax.invert_yaxis()
    ax.set_title("Badput by cause")
    ax.set_xlabel("% of wall-clock time")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right")


def _mtbf(ax: Any, report: Report, mtbf: list[tuple[int, float]]) -> None:
    gpu_mtbf_h = report.params["gpu_mtbf_hours"]
    sizes = [gpus for gpus, _ in mtbf]
    ax.loglog(sizes, [gpu_mtbf_h / g for g in sizes], label=f"GPU MTBF / GPUs ({gpu_mtbf_h:,.0f} h per GPU)")
    ax.loglog(
        sizes, [s / 3600 for _, s in mtbf], "o", label=f"simulated interruptions, {Path(report.policy).name}"
    )
    for gpus, seconds in mtbf:
        ax.annotate(
            f"{seconds / 3600:.2g} h", (gpus, seconds / 3600), textcoords="offset points", xytext=(6, 4)
        )
    ax.set_title("Time between job interruptions vs cluster size")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("hours")
    ax.grid(which="both", alpha=0.3)
    ax.legend()
