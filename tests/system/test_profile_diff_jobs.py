"""Why a rank is slow, end to end: the reference job under a real torchrun (2 ranks on the CPU, gloo),
rank 1 slowed by an injected cause, both ranks profiled on request while the job runs, and the two
traces diffed (medic/profile_diff.py). The accuracy over many runs is in BENCHMARKS.md
(tests/bench/profile_diff.py); the diff's own cases run on recorded traces in tests/domain/test_profile_diff.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.profile_diff import PEER, SUSPECT, profile_pair

from medic.profile_diff import Cause, read_summary

pytestmark = pytest.mark.system


# One cause here: a software cause (a Python hot spot) runs the same way under torchrun in
# tests/system/test_straggler_cause_jobs.py, and every cause's recorded pair in the domain tests.
def test_a_slowed_rank_is_told_apart_by_its_profile(tmp_path: Path) -> None:
    expected, where = Cause.HARDWARE_COMPUTE, "aten::linear"  # a slow GPU's stand-in: drain-worthy
    run = profile_pair(tmp_path, "compute", steps=6, after=0)
    assert run.suspect.name.startswith(f"reference-train-r{SUSPECT}-step")
    assert run.peer.name.startswith(f"reference-train-r{PEER}-step")
    # One request file per rank, taken at the same poll: the same steps (give or take one) on both.
    mine, theirs = ({s.step for s in read_summary(p).steps} for p in (run.suspect, run.peer))
    assert len(mine) == len(theirs) == 6 and len(mine & theirs) >= 5
    diff = run.diff()
    assert diff.cause is expected, diff.reason
    assert where in diff.evidence[0].name
    assert diff.facts()["straggler_cause_hardware"] is expected.hardware
