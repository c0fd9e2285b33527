"""Statistics over repeated samples, and the markdown of BENCHMARKS.md."""

from __future__ import annotations

import math
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Stats:
    """A summary of repeated measurements (each sample: one repeat)."""

    n: int
    median: float
    low: float
    high: float
    p95: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        if not samples:
            raise ValueError("no samples")
        ordered = sorted(samples)
        rank = max(1, math.ceil(0.95 * len(ordered)))  # nearest-rank p95
        return cls(len(ordered), statistics.median(ordered), ordered[0], ordered[-1], ordered[rank - 1])


def rate(count: float, stats: Stats) -> Stats:
    """Seconds per batch of `count` items -> items per second (the fastest batch is the highest rate)."""
    return Stats(stats.n, count / stats.median, count / stats.high, count / stats.low, count / stats.p95)


def num(value: float, digits: int = 3) -> str:
    """A figure with `digits` significant digits and thousands separators."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{round(value, decimals):,.{decimals}f}"


def ms(seconds: float) -> str:
    return f"{num(seconds * 1000)} ms"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_line(cores: int) -> str:
    python = f"Python {platform.python_version()} ({platform.python_implementation()})"
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{cores} cores (`nproc`), {cpu_model()}, {python}, {platform.system()} {platform.release()}, {date}"
    )


def document(command: str, machine: str, total_s: float, sections: Sequence[str]) -> str:
    intro = [
        "# Benchmarks",
        "",
        "Throughput of the policy engine and of `medic triage`, and what running a remediation as a",
        "Prefect flow costs per incident over calling the same task functions directly. Every figure is",
        "measured with repeats; tables give the median and the spread (min-max, p95 where there are",
        "enough samples). Numbers are from one run on the machine below; compare runs only on the same",
        "machine. The machine may be shared: the load average is recorded with it, and a wide",
        "min - max spread is the sign of other work running at the same time.",
        "",
        f"**Machine:** {machine}",
        "",
        f"**Command:** `{command}` (all benchmarks, {total_s:.0f} s in total; rewrites this file)",
        "",
    ]
    reproduce = [
        "## Reproduce",
        "",
        "From the repository root:",
        "",
        "```sh",
        command,
        "```",
        "",
        "It needs nothing outside the repository: events and policies are generated into a temporary",
        "directory, the flow benchmark starts its own temporary Prefect server with a fresh",
        "`PREFECT_HOME` and a temporary SQLite store, and all backends are the simulated fleet",
        "(`medic.integrations.registry.simulated`). The code is in `bench/` (one module per benchmark).",
        f"Interpreter: `{sys.executable}`.",
        "",
    ]
    body = "\n".join(s.rstrip() + "\n" for s in sections)
    return "\n".join(intro) + "\n" + body + "\n" + "\n".join(reproduce)
