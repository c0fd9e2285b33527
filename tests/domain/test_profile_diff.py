"""The profile differential (medic/profile_diff.py) on real torch.profiler traces of the reference job:
2 ranks under torchrun on the CPU, rank 1 slowed by one injected cause, both ranks profiled over the same
steps on request (tests/fixtures/profiles/SOURCES.md says how they were recorded)."""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

import pytest

from medic import profile_diff
from medic.profile_diff import (
    Category,
    Cause,
    ProfileDiff,
    ProfileSummary,
    Spent,
    StepSummary,
    Thresholds,
    compare,
    diagnose,
    read_summary,
)
from medic.shipped import DEMO_PROFILES

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "profiles"
DATA_LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
BATCH_COPY = "aten::to|[[32,16],[],[],[],[],[],[],[]]"


def trace(cause: str, rank: int) -> Path:
    folder = DEMO_PROFILES if cause == "compute" else FIXTURES  # the package ships the demo's pair
    return folder / f"{cause}-r{rank}.pt.trace.json.gz"


@functools.cache  # each trace is read once for the module: ~0.3 s apiece
def summary(cause: str, rank: int) -> ProfileSummary:
    return read_summary(trace(cause, rank))


def pair(cause: str, suspect: int = 1, peer: int = 0) -> ProfileDiff:
    return compare(summary(cause, suspect), summary(cause, peer))


def test_each_profiled_step_is_split_over_the_categories_of_the_training_thread() -> None:
    steps = summary("none", 0).steps
    assert [s.step for s in steps] == [517, 518, 519, 520]  # the ProfilerStep#N spans, numbered as the job's
    for step in steps:
        # Every slice of the thread's time in the step goes to one category, once (within the clock's
        # rounding and the record_function marks that outlast the call opening them).
        assert sum(step.categories.values()) == pytest.approx(step.seconds, rel=0.05)
        calls = {key: spent.calls for key, spent in step.entries.items()}
        assert calls[f"input|{DATA_LOADER}|"] == 1  # one batch a step from the DataLoader
        assert calls["communication|c10d::allreduce_|[[[5313]],[],[],[],[],[]]"] == 1  # DDP's one bucket
        assert calls[f"copy|{BATCH_COPY}"] == 1  # the batch's host copy
        linears = [k for k in calls if k.startswith("compute|aten::linear|")]
        assert len(linears) == 3 and all(calls[k] == 1 for k in linears)  # the MLP's three layers
        # The operators inside aten::linear (addmm, its copy_) are booked to it, not counted again.
        assert not any(k.startswith(("compute|aten::addmm|", "copy|aten::copy_|")) for k in calls)


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path: Path) -> None:
    plain = tmp_path / "none-r0.pt.trace.json"
    plain.write_bytes(gzip.decompress(trace("none", 0).read_bytes()))
    assert read_summary(plain) == summary("none", 0)


@pytest.mark.parametrize(
    ("cause", "expected", "category", "where"),
    [
        ("compute", Cause.HARDWARE_COMPUTE, Category.COMPUTE, "aten::linear"),
        ("copy", Cause.HARDWARE_IO, Category.COPY, "aten::to"),
        ("input", Cause.SOFTWARE_INPUT, Category.INPUT, DATA_LOADER),
        ("python", Cause.SOFTWARE_PYTHON, Category.PYTHON, "medic/training/train.py"),
    ],
)
def test_the_injected_cause_is_named_with_what_grew(
    cause: str, expected: Cause, category: Category, where: str
) -> None:
    diff = pair(cause)
    assert diff.cause is expected, diff.reason
    assert diff.confidence >= 0.8
    assert next(g.category for g in diff.categories if g.significant) is category
    top = diff.evidence[0]
    assert top.category is category and where in top.name
    assert top.growth_s >= 0.002  # the injection adds 3 ms a call, a batch or a step
    assert diff.facts() == {
        "straggler_cause": str(expected),
        "straggler_cause_confidence": round(diff.confidence, 3),
        "straggler_cause_hardware": expected.hardware,
        "straggler_cause_where": top.name,
    }


def test_a_hot_spot_is_named_by_its_function() -> None:
    diff = pair("python")
    assert [e.name.rsplit(": ", 1)[-1] for e in diff.evidence] == ["injected_hot_spot"]
    assert diff.evidence[0].peer_calls == 0  # the healthy peer never runs it


def test_the_slowed_operators_are_the_same_calls_at_the_same_shapes() -> None:
    diff = pair("compute")
    assert {e.name for e in diff.evidence} == {"aten::linear"}
    assert all(e.suspect_calls == e.peer_calls == 1 and e.ratio and e.ratio > 2 for e in diff.evidence)


def test_the_control_pair_names_nothing() -> None:
    diff = diagnose(trace("none", 1), trace("none", 0))  # from the files, as GPU Medic reads them
    assert diff == pair("none")
    assert diff.cause is Cause.NONE, diff.reason
    assert diff.facts()["straggler_cause_where"] is None


def test_a_wait_that_moved_from_one_rank_to_the_other_is_no_cause() -> None:
    # A control pair in which rank 1 waited for the all-reduce inside c10d::allreduce_ and rank 0
    # inside the autograd engine (a builtin: other), some 4 ms a step each.
    diff = pair("moved")
    grown = {g.category for g in diff.categories if g.significant}
    assert grown == {Category.COMMUNICATION}  # on its own, the collective stands out
    assert diff.cause is Cause.NONE, diff.reason  # with the peer's wait beside it, nothing grew
    assert pair("moved", suspect=0, peer=1).cause is Cause.NONE


def test_a_peer_waiting_on_the_slow_rank_is_never_blamed() -> None:
    # The roles swapped: the "suspect" is the healthy rank that waited for the slow one.
    for cause in ("compute", "copy", "input", "python"):
        diff = pair(cause, suspect=0, peer=1)
        assert not diff.cause.hardware and not diff.cause.software, (cause, diff.reason)


def doubled(summary: ProfileSummary, name: str) -> ProfileSummary:
    """The same steps as if the code ran every `name` call twice: more calls, each as long."""

    def step(s: StepSummary) -> StepSummary:
        extra = {k: e for k, e in s.entries.items() if s.names[k].name == name}
        grown = sum(e.seconds for e in extra.values())
        entries = s.entries | {k: Spent(seconds=2 * e.seconds, calls=2 * e.calls) for k, e in extra.items()}
        categories = s.categories | {Category.COMPUTE: s.categories[Category.COMPUTE] + grown}
        return s.model_copy(
            update={"entries": entries, "categories": categories, "seconds": s.seconds + grown}
        )

    return ProfileSummary(steps=[step(s) for s in summary.steps])


def test_more_calls_of_an_operator_is_not_a_slower_device() -> None:
    peer = summary("compute", 0)
    suspect = doubled(peer, "aten::linear")
    # Three small layers twice over add little to a step: judge the kind of growth, not its size.
    limits = Thresholds(min_share=0, min_growth_s=0, min_ratio=1)
    diff = compare(suspect, peer, limits)
    assert diff.cause is Cause.UNKNOWN and "more or other calls" in diff.reason, diff.reason


def test_profiles_of_different_steps_give_no_verdict() -> None:
    diff = compare(summary("compute", 1), summary("copy", 0))  # steps 241-244 against 338-340
    assert diff.cause is Cause.UNKNOWN and diff.steps == [] and "in common" in diff.reason


def test_a_trace_over_the_size_a_diff_reads_is_unknown_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's Python can make its trace hundreds of MB: the diff says so rather than take minutes."""
    size = len(gzip.decompress(trace("python", 1).read_bytes()))
    monkeypatch.setattr(profile_diff, "MAX_TRACE_BYTES", size - 1)  # the real one is 96 MiB
    diff = diagnose(trace("python", 1), trace("python", 0))
    assert diff.cause is Cause.UNKNOWN and diff.confidence == 0
    assert "over the" in diff.reason and "MiB a diff reads" in diff.reason
    monkeypatch.setattr(profile_diff, "MAX_TRACE_BYTES", size)
    assert diagnose(trace("python", 1), trace("python", 0)).cause is Cause.SOFTWARE_PYTHON


def test_a_trace_that_cannot_be_read_gives_unknown_never_a_cause(tmp_path: Path) -> None:
    whole = gzip.decompress(trace("compute", 1).read_bytes())
    cut = tmp_path / "cut.pt.trace.json"
    cut.write_bytes(whole[: len(whole) // 2])  # a trace still being written, or a full disk
    diff = diagnose(cut, trace("compute", 0))
    assert diff.cause is Cause.UNKNOWN and diff.confidence == 0 and "cannot read" in diff.reason
    assert diagnose(tmp_path / "absent.json", trace("compute", 0)).cause is Cause.UNKNOWN
    no_steps = tmp_path / "no-steps.pt.trace.json"
    no_steps.write_text('{"traceEvents": []}')  # what a profile that caught no step writes
    assert "ProfilerStep" in diagnose(no_steps, trace("compute", 0)).reason
