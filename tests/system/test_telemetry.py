"""Item 4 of issue 40 at a size the test machine allows (tests/bench/telemetry.py, whose figures are in
BENCHMARKS.md, "At fleet scale"): a job's step timings, one report per rank per 10 steps, each in
its own POST, through `medic serve` on PostgreSQL with a Prefect server, while fatal XIDs arrive
beside them. Every report is stored, the slow rank is named in every round, and the fatal nodes
are drained. Behind two replicas that split the job's reports, no step is ever complete in either:
nobody is named, which the replicas log (tests/domain/test_peers.py pins that it is told)."""

from __future__ import annotations

import pytest
from bench.telemetry import run

pytestmark = pytest.mark.system


def test_a_jobs_step_timings_name_its_slow_rank_every_round_beside_containment() -> None:
    result = run(ranks=64, rate=100, seconds=6)
    assert result["stored"] >= result["reports"] == 64 * result["rounds"]
    assert result["verdicts"] == result["rounds"] == 9
    assert result["probes"] >= 2 and result["probes_drained"] == result["probes"]


def test_a_job_split_between_two_replicas_is_judged_by_neither() -> None:
    result = run(ranks=64, rate=100, seconds=6, replicas=2, route="round")
    assert result["stored"] >= result["reports"]
    assert result["verdicts"] == 0
