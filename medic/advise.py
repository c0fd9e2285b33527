"""How often to checkpoint: Young's first-order optimum (docs/checkpoints.md).

With saves taking `δ` seconds and the job failing on average every `M` seconds, checkpointing
every `τ` seconds costs a fraction `δ/τ` of the time to saving, and each failure repeats on
average half an interval of work, a fraction `τ/(2M)`. Their sum is least at

    τ = sqrt(2·δ·M)                          (Young 1974; Daly 2006 to first order)

where the two terms are equal and the overhead is sqrt(2·δ/M). Daly's higher-order form
shortens τ by about (2/3)·sqrt(δ/(2M)) (0.7% for Llama 3's 2.5 s saves and 3.1 h MTBF) and
moves the overhead far less, since the optimum is flat; it is not applied here.

A job on G GPUs fails whenever any one of them does, so with independent failures its MTBF
is the per-GPU MTBF divided by G.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class CheckpointAdvice:
    save_seconds: float
    job_mtbf_seconds: float
    interval_seconds: float
    save_overhead: float  # fraction of wall time spent saving
    rework_overhead: float  # fraction of wall time redoing work lost to failures

    @property
    def overhead(self) -> float:
        return self.save_overhead + self.rework_overhead


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number, not {value}")


def job_mtbf_hours(gpu_mtbf_hours: float, gpus: int) -> float:
    """MTBF of a job (or cluster) of `gpus` GPUs that fail independently."""
    _positive(gpu_mtbf_hours=gpu_mtbf_hours, gpus=gpus)
    return gpu_mtbf_hours / gpus


def observed_mtbf_hours(failures: int, days: float) -> float:
    """MTBF from a failure count over a period, e.g. 419 interruptions in 54 days."""
    _positive(failures=failures, days=days)
    return days * 24 / failures


def overhead(save_seconds: float, interval_seconds: float, mtbf_seconds: float) -> float:
    """Fraction of wall time lost: δ/τ saving plus τ/(2M) of work redone after failures."""
    _positive(save_seconds=save_seconds, interval_seconds=interval_seconds, mtbf_seconds=mtbf_seconds)
    return save_seconds / interval_seconds + interval_seconds / (2 * mtbf_seconds)


def optimal_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's τ = sqrt(2·δ·M)."""
    _positive(save_seconds=save_seconds, mtbf_seconds=mtbf_seconds)
    if save_seconds >= 2 * mtbf_seconds:
        # Outside the model's range: the job would fail, on average, before a save finishes.
        raise ValueError(
            f"a {save_seconds:g} s save is too slow for a {mtbf_seconds:g} s MTBF (needs save < 2 * MTBF)"
        )
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def advise_checkpoint(save_seconds: float, job_mtbf_hours: float) -> CheckpointAdvice:
    mtbf = job_mtbf_hours * SECONDS_PER_HOUR
    interval = optimal_interval(save_seconds, mtbf)
    return CheckpointAdvice(
        save_seconds=save_seconds,
        job_mtbf_seconds=mtbf,
        interval_seconds=interval,
        save_overhead=save_seconds / interval,
        rework_overhead=interval / (2 * mtbf),
    )


def human_seconds(seconds: float) -> str:
    """3.9 min, 5.0 h, 42 s: the unit a person would say."""
    if seconds >= 2 * SECONDS_PER_HOUR:
        return f"{seconds / SECONDS_PER_HOUR:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"
