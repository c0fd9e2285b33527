"""Peer comparison (medic/peers.py) and the intake differential that feeds it (medic/culprit.py)."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest
from factories import fault_event
from hypothesis import given, settings
from hypothesis import strategies as st

from medic.culprit import differential
from medic.events import EventKind, FaultEvent
from medic.intake import read_lines
from medic.peers import TIMINGS_CHECK, PeerDetector, Thresholds, detect, judge, others_spread, timings_of
from medic.profiles import LOOKBACK
from medic.training.medic_hooks import MedicHooks

JOB, WORLD, EVERY = "llm", 8, 10
NODE_OF = {rank: f"gpu-{rank // 4:03d}" for rank in range(WORLD)}  # 4 ranks per node


def reports(
    steps: int,
    base: float = 0.5,
    slow: dict[int, float] | None = None,
    jitter: float = 0.02,
    seed: int = 7,
    every: int = EVERY,
) -> list[FaultEvent]:
    """Every rank's step-timings reports for steps 1..steps; `slow` maps rank → its time factor."""
    rng = random.Random(seed)
    slow = slow or {}
    out = []
    for first in range(1, steps + 1, every):
        for rank in range(WORLD):
            times = [
                round(base * slow.get(rank, 1.0) * (1 + rng.uniform(-jitter, jitter)), 6)
                for _ in range(every)
            ]
            out.append(
                fault_event(
                    "health_check",
                    node=NODE_OF[rank],
                    gpu=rank % 4,
                    job=JOB,
                    rank=rank,
                    iteration=first + every - 1,
                    seconds=first + every,
                    source="job",
                    attributes={
                        "check": TIMINGS_CHECK,
                        "first_step": first,
                        "world_size": WORLD,
                        "step_times_s": [base * 2] * every,  # wall time: every rank waits alike
                        "compute_s": times,
                    },
                )
            )
    return out


def test_a_rank_30_percent_slower_is_named_with_its_node_and_gpu() -> None:
    [first, *rest] = detect(reports(40, slow={5: 1.3}))
    assert (first.kind, first.node, first.gpu, first.rank, first.job) == (
        EventKind.STRAGGLER,
        "gpu-001",
        1,
        5,
        JOB,
    )
    assert first.source == "medic"
    attributes = first.attributes
    assert attributes["detector"] == "peer" and attributes["peers"] == WORLD - 1
    assert 1.25 <= attributes["step_time_ratio"] <= 1.35
    assert attributes["confidence"] == 1.0
    assert {e.rank for e in rest} == {5}


def test_every_rank_slower_together_names_nobody() -> None:
    assert detect(reports(40, slow=dict.fromkeys(range(WORLD), 1.5))) == []


def test_most_ranks_slower_is_the_job_not_a_gpu() -> None:
    assert detect(reports(40, slow=dict.fromkeys(range(5), 1.5))) == []


def test_jitter_alone_names_nobody() -> None:
    assert detect(reports(200, jitter=0.1, seed=3)) == []


def test_a_slowdown_under_the_ratio_is_no_straggler() -> None:
    # It stands out from a tight pack every step, but 10% is no hardware straggler.
    assert detect(reports(40, slow={2: 1.1}, jitter=0.001)) == []


def test_no_verdict_before_min_steps_from_every_rank() -> None:
    events = [e for e in reports(40, slow={5: 1.3}) if e.rank != 0]  # rank 0 never reported
    assert detect(events) == []
    assert detect(reports(5, slow={5: 1.3}, every=5)) == []  # too few steps


def test_a_slowdown_that_starts_midway_is_found_within_a_window() -> None:
    before = reports(30)
    after = [e for e in reports(60, slow={6: 1.3}) if e.attributes["first_step"] > 30]
    found = detect(before + after)
    assert found and {e.rank for e in found} == {6}
    assert found[0].iteration is not None and found[0].iteration <= 50  # two reports after the onset


def test_ids_are_the_same_on_a_replay() -> None:
    events = reports(40, slow={5: 1.3})
    assert [e.id for e in detect(events)] == [e.id for e in detect(events)]


def test_two_ranks_cannot_tell_a_slow_gpu_from_a_fast_one() -> None:
    two = {step: {0: 1.0, 1: 2.0} for step in range(20)}
    assert judge(two, Thresholds()) == []
    assert judge(two, Thresholds(min_peers=1)) == []  # one of two is half the job: no culprit
    three = {step: {0: 1.0, 1: 2.0, 2: 1.0} for step in range(20)}
    assert [v.rank for v in judge(three, Thresholds())] == [1]


def test_a_restart_at_another_world_size_starts_over() -> None:
    detector = PeerDetector()
    for event in reports(10, slow={5: 1.3}):
        detector.push(event)
    smaller = fault_event(
        "health_check",
        job=JOB,
        rank=0,
        attributes={"check": TIMINGS_CHECK, "first_step": 1, "world_size": 4, "step_times_s": [1.0]},
    )
    detector.push(smaller)
    assert detector.jobs[JOB].world_size == 4 and list(detector.jobs[JOB].times) == [1]


@pytest.mark.parametrize(
    "attributes",
    [
        {"check": "nvidia-smi"},
        {"check": TIMINGS_CHECK, "first_step": 1, "world_size": 4},
        {"check": TIMINGS_CHECK, "first_step": 1, "world_size": 4, "step_times_s": []},
        {"check": TIMINGS_CHECK, "first_step": -1, "world_size": 4, "step_times_s": [1.0]},
    ],
    ids=["another check", "no times", "empty times", "negative step"],
)
def test_what_is_not_a_timings_report(attributes: dict[str, object]) -> None:
    assert timings_of(fault_event("health_check", job=JOB, rank=0, attributes=attributes)) is None


def test_the_differential_absorbs_reports_and_hands_on_everything_else() -> None:
    xid = fault_event("xid", node="gpu-009", seconds=1)
    out = differential([xid, *reports(40, slow={5: 1.3})])
    assert out[0] == xid
    assert {e.kind for e in out[1:]} == {EventKind.STRAGGLER}


def test_read_lines_gives_the_culprit_instead_of_the_reports() -> None:
    lines = [e.model_dump_json() for e in reports(40, slow={5: 1.3})]
    intake = read_lines(lines, "events.jsonl")
    assert intake.rejected == []
    assert {(e.kind, e.node) for e in intake.events} == {(EventKind.STRAGGLER, "gpu-001")}


def test_an_input_without_reports_comes_out_as_it_went_in() -> None:
    events = [fault_event("nccl_timeout", job=JOB, rank=r, seconds=r) for r in range(3)]
    events.append(fault_event("straggler", job=JOB, rank=1, seconds=9))
    assert differential(events) == events


def profile_report(rank: int, seconds: float) -> FaultEvent:
    """What a rank's hooks report once its own profile is written (medic_hooks.MedicHooks.profiled)."""
    artifact = f"/shared/medic/{JOB}-r{rank}-step4-profile.pt.trace.json"
    attributes = {
        "check": "profile",
        "artifact": artifact,
        "reason": "slowdown",
        "first_step": 4,
        "last_step": 6,
    }
    return fault_event(
        "health_check",
        node=NODE_OF[rank],
        job=JOB,
        rank=rank,
        seconds=seconds,
        source="job",
        attributes=attributes,
    )


def test_a_rank_s_profile_is_no_incident_and_goes_with_the_straggler_named_about_it() -> None:
    mine, another = profile_report(5, seconds=8), profile_report(2, seconds=9)
    out = differential([mine, another, *reports(40, slow={5: 1.3})])
    assert out and all(e.kind is EventKind.STRAGGLER and e.rank == 5 for e in out)
    assert {(e.attributes["artifact"], e.attributes["profile_event"]) for e in out} == {
        (mine.attributes["artifact"], mine.id)
    }


def test_a_profile_from_long_before_is_no_evidence_of_this_slowdown() -> None:
    out = differential([profile_report(5, seconds=-LOOKBACK.total_seconds()), *reports(40, slow={5: 1.3})])
    assert out and all("artifact" not in e.attributes for e in out)


# --- The hooks' side: what a rank reports (medic/training/medic_hooks.py) -------------------


def rank_hooks(sink: Path, rank: int = 1, **options: object) -> MedicHooks:
    options = {"world_size": WORLD, **options}
    return MedicHooks(job=JOB, node="gpu-000", rank=rank, sink=sink, **options)  # type: ignore[arg-type]


def written(sink: Path) -> list[FaultEvent]:
    return [FaultEvent.model_validate_json(line) for line in sink.read_text().splitlines()]


def test_the_hooks_report_each_window_of_steps_as_a_valid_timings_report(tmp_path: Path) -> None:
    sink = tmp_path / "events.jsonl"
    hooks = rank_hooks(sink, timings_every=4)
    for step in range(1, 10):
        hooks.collective()
        assert all(e.kind == "health_check" for e in hooks.step(step, 1.0, 2.0))  # never a straggler
    [first, second] = written(sink)
    timings = timings_of(first)
    assert timings is not None and (timings.first_step, timings.world_size) == (1, WORLD)
    assert timings.step_times_s == [2.0] * 4
    # Entered its collective "now", so its own work was (almost) the whole step.
    assert timings.compute_s is not None and all(1.99 < c <= 2.0 for c in timings.compute_s)
    assert (first.iteration, timings_of(second).first_step) == (4, 5)  # type: ignore[union-attr]


def test_without_collectives_the_report_has_wall_times_only(tmp_path: Path) -> None:
    sink = tmp_path / "events.jsonl"
    hooks = rank_hooks(sink, timings_every=2)
    hooks.step(1, 1.0, 0.5)
    hooks.step(2, 1.0, 0.7)
    [report] = written(sink)
    assert "compute_s" not in report.attributes
    assert timings_of(report).times() == [0.5, 0.7]  # type: ignore[union-attr]


def test_a_gap_in_the_steps_starts_a_new_window(tmp_path: Path) -> None:
    sink = tmp_path / "events.jsonl"
    hooks = rank_hooks(sink, timings_every=3)
    for step in (1, 2, 5, 6, 7):
        hooks.step(step, 1.0, 0.5)
    [report] = written(sink)
    assert report.attributes["first_step"] == 5


@pytest.mark.parametrize(
    "options",
    [{"timings_every": 0}, {"timings_every": 401}, {"timings_every": 5, "world_size": None}],
    ids=["zero", "over the attribute limit", "no world size"],
)
def test_bad_timing_options_fail_when_the_hooks_are_made(tmp_path: Path, options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="timings_every"):
        rank_hooks(tmp_path / "events.jsonl", **options)


def test_a_rank_that_stops_reporting_costs_bounded_memory() -> None:
    detector = PeerDetector()
    for event in reports(1000):
        if event.rank != 0 or event.attributes["first_step"] <= 10:
            detector.push(event)
    assert len(detector.jobs[JOB].times) <= 4 * Thresholds().window_steps


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(st.sampled_from([1.0, 1.0, 2.5, 0.0]), st.floats(0, 100, allow_nan=False)),
        min_size=2,
        max_size=60,
    )
)
def test_each_ranks_peers_spread_is_what_the_median_of_the_others_gives(values: list[float]) -> None:
    """The O(n log n) comparison gives, to the bit, what the median of the others gives for each
    value (ties and small jobs included: those are where leaving one out matters)."""
    expected = []
    for i in range(len(values)):
        others = values[:i] + values[i + 1 :]
        median = statistics.median(others)
        expected.append((median, statistics.median(abs(t - median) for t in others)))
    assert others_spread(values) == expected


def test_a_job_whose_reports_are_split_elsewhere_is_said_to_be_unjudged() -> None:
    """A load balancer that spreads a job's reports over replicas leaves each a share: no step
    ever completes here, which is not "no straggler" and must be told apart from it."""
    split, whole = PeerDetector(), PeerDetector()
    events = reports(200, slow={5: 1.5})
    for event in events:
        whole.push(event)
        if event.rank is not None and event.rank % 2 == 0:  # this replica's share
            assert split.push(event) == []
    assert split.never_complete() == [(JOB, WORLD // 2, WORLD)]
    assert whole.never_complete() == []
