"""Benchmarks for GPU Medic: `PYTHONPATH=tests PYTHONPATH=tests python -m bench` runs them all and writes BENCHMARKS.md.

One module per benchmark (policy, triage, flow_overhead), each with `run()` (measure, return
results) and `section(results)` (its markdown); report.py holds the statistics and the layout.
"""

from pathlib import Path

# The repository the benchmarks run from and write BENCHMARKS.md into (the product never reads it).
REPO_ROOT = Path(__file__).resolve().parents[2]
# Where `bench` is importable from: a benchmark that starts `PYTHONPATH=tests python -m bench.NAME` puts it on PYTHONPATH.
IMPORT_ROOT = str(Path(__file__).resolve().parents[1])
