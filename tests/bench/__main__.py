"""`PYTHONPATH=tests python -m bench`: run every benchmark, one at a time, and write BENCHMARKS.md at the repo root.

`PYTHONPATH=tests python -m bench NAME` (e.g. `PYTHONPATH=tests python -m bench sentry`) runs that one and prints its section.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import (
    REPO_ROOT,
    ageing,
    agent,
    flow_overhead,
    hang,
    hooks_sink,
    hostile,
    ingest,
    live,
    node_bundle,
    policy,
    profile_diff,
    prolog,
    recovery,
    replay,
    report,
    resume,
    sentry,
    simulate,
    triage,
)

COMMAND = "PYTHONPATH=tests .venv/bin/python -m bench"
BENCHMARKS: list[tuple[str, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], str]]] = [
    ("policy decisions", policy.run, policy.section),
    ("medic triage", triage.run, triage.section),
    ("flow overhead", flow_overhead.run, flow_overhead.section),
    ("http ingest", ingest.run, ingest.section),
    ("live path", live.run, live.section),
    ("sentry", sentry.run, sentry.section),
    ("hostile", hostile.run, hostile.section),
    ("node agent", agent.run, agent.section),
    ("node_bundle", node_bundle.run, node_bundle.section),
    ("slurm prolog", prolog.run, prolog.section),
    ("simulate", simulate.run, simulate.section),
    ("policy replay", replay.run, replay.section),
    ("ageing", ageing.run, ageing.section),
    ("training resume", resume.run, resume.section),
    ("hang", hang.run, hang.section),
    ("profile diff", profile_diff.run, profile_diff.section),
    ("recovery", recovery.run, recovery.section),
    ("hooks sink", hooks_sink.run, hooks_sink.section),
]


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f}"


def main() -> int:
    if len(sys.argv) > 1:
        return _one(sys.argv[1])
    started = time.perf_counter()
    cores = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))  # what `nproc` prints
    load_before = _load()
    sections = []
    for name, run, section in BENCHMARKS:
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        began = time.perf_counter()
        results = run()
        sections.append(section(results))
        print(f"bench: {name} done in {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    total = time.perf_counter() - started
    machine = (
        report.machine_line(cores) + f"; load average (1/5 min) {load_before} at start, {_load()} at end"
    )
    text = report.document(COMMAND, machine, total, sections)
    target = REPO_ROOT / "BENCHMARKS.md"
    target.write_text(text, encoding="utf-8")
    print(f"bench: wrote {target} in {total:.0f} s", file=sys.stderr)
    return 0


def _one(name: str) -> int:
    """Run one benchmark by name and print its section (BENCHMARKS.md is left as it is)."""
    found = {n: (run, section) for n, run, section in BENCHMARKS}
    if name not in found:
        print(f"bench: no benchmark {name!r}; one of {', '.join(found)}", file=sys.stderr)
        return 2
    run, section = found[name]
    print(section(run()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
