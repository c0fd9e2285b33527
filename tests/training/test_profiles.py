"""The deep look at a suspected slow rank: when its hooks ask for a profile (medic_hooks.py), how the
reference job takes it (profiling.py), and how the evidence names the file (medic/artifacts.py).
The whole path in a real torchrun job is in tests/system/test_culprit_jobs.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from factories import fault_event

from medic.artifacts import Artifact, ArtifactLinks, artifacts_of
from medic.events import EventKind, FaultEvent
from medic.training.medic_hooks import MAX_PROFILE_STEPS, MedicHooks, Slowdown
from medic.training.profiling import StepProfiler

JOB, RANK = "llm", 2
REQUEST = f"{JOB}-r{RANK}.profile-request"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def armed(tmp_path: Path, clock: Clock | None = None, **options: object) -> MedicHooks:
    hooks = MedicHooks(
        job=JOB, node="node-b", rank=RANK, sink=tmp_path / "events.jsonl", clock=clock or Clock()
    )
    hooks.profile_on_demand(tmp_path / "artifacts", **options)  # type: ignore[arg-type]
    return hooks


def run_steps(hooks: MedicHooks, steps: range, seconds: float) -> list[int]:
    """A loop that profiles whenever asked (writing no trace): the steps each profile began at."""
    began: list[int] = []
    request = None
    for step in steps:
        if request is None and (request := hooks.profile_wanted()) is not None:
            began.append(step)
        hooks.step(step, 1.0, seconds)
        if request is not None and step - began[-1] + 1 == request.steps:
            assert hooks.profiled(request, began[-1], step) is None  # no trace written: nothing to report
            request = None
    return began


def profiles(tmp_path: Path) -> list[FaultEvent]:
    """The profile reports written (a rank judging itself also writes its own stragglers)."""
    sink = tmp_path / "events.jsonl"
    lines = sink.read_text().splitlines() if sink.exists() else []
    events = [FaultEvent.model_validate_json(line) for line in lines]
    return [e for e in events if e.attributes.get("check") == "profile"]


def test_a_rank_whose_own_work_slows_asks_once_and_reports_the_profile(tmp_path: Path) -> None:
    clock = Clock()
    hooks = armed(tmp_path, clock, steps=3)
    assert run_steps(hooks, range(1, 16), 0.1) == []
    assert run_steps(hooks, range(16, 18), 0.13) == []  # two slow steps of five: a blip so far
    hooks.step(18, 1.0, 0.13)
    request = hooks.profile_wanted()
    assert request is not None and (request.reason, request.steps) == ("slowdown", 3)
    assert request.figures["slowdown_ratio"] == 1.3 and request.figures["baseline_median_s"] == 0.1
    assert request.path.parent == (tmp_path / "artifacts").absolute()
    assert run_steps(hooks, range(19, 22), 0.5) == []  # under the profiler: no trigger, no baseline
    request.path.write_text('{"traceEvents": []}')
    event = hooks.profiled(request, 19, 21)
    assert event is not None and profiles(tmp_path) == [FaultEvent.model_validate_json(event.to_json())]
    [report] = profiles(tmp_path)
    assert (report.kind, report.iteration, report.rank) == (EventKind.HEALTH_CHECK, 21, RANK)
    assert report.attributes | {"phase": "healthcheck"} == {
        "phase": "healthcheck",
        "check": "profile",
        "artifact": str(request.path),
        "reason": "slowdown",
        "first_step": 19,
        "last_step": 21,
        **request.figures,
    }
    # The slower pace is the new baseline: staying slow asks for nothing more, even after the cooldown.
    clock.now += 3600
    assert run_steps(hooks, range(22, 60), 0.13) == []


def test_a_second_slowdown_waits_out_the_cooldown(tmp_path: Path) -> None:
    clock = Clock()
    hooks = armed(tmp_path, clock, cooldown_s=600)
    assert run_steps(hooks, range(1, 16), 0.1) == []
    assert run_steps(hooks, range(16, 50), 0.13) == [19]  # the third slow step tips the median
    assert run_steps(hooks, range(50, 80), 0.2) == []  # slower again, within the cooldown
    clock.now += 600
    assert run_steps(hooks, range(80, 85), 0.2) == [81]  # still slower than before it: asked now
    assert profiles(tmp_path) == []


def test_a_rank_waiting_for_a_slow_peer_has_not_slowed(tmp_path: Path) -> None:
    hooks = armed(tmp_path, slowdown=Slowdown(min_step_s=0.005))  # short steps keep the test short
    for step in range(1, 26):
        waited = 0.01 if step > 15 else 0.0
        hooks.collective()  # its own work done: it enters the step's collective
        time.sleep(waited)  # ... and waits there for the slow peer
        assert hooks.profile_wanted() is None
        hooks.step(step, 1.0, 0.02 + waited)  # the wall time grew by half; its work did not
    assert profiles(tmp_path) == []


def test_a_request_file_asks_for_one_profile_of_the_steps_it_says(tmp_path: Path) -> None:
    clock = Clock()
    hooks = armed(tmp_path, clock, steps=3, poll_s=5)
    assert hooks.profile_wanted() is None  # polled: nothing asked
    request_file = tmp_path / "artifacts" / REQUEST
    request_file.write_text(json.dumps({"steps": 7}))
    assert hooks.profile_wanted() is None  # not looked for again within poll_s
    clock.now += 5
    request = hooks.profile_wanted()
    assert request is not None and (request.reason, request.steps, request.figures) == ("requested", 7, {})
    assert not request_file.exists()  # taken: one request, one profile
    hooks.profiled(request, 1, 7)
    clock.now += 5
    assert hooks.profile_wanted() is None


def test_a_request_from_a_step_starts_at_that_step_and_not_before(tmp_path: Path) -> None:
    hooks = armed(tmp_path, steps=3)
    (tmp_path / "artifacts" / REQUEST).write_text(json.dumps({"steps": 4, "from_step": 10}))
    assert run_steps(hooks, range(1, 30), 0.1) == [10]  # read at the first step, taken at the tenth
    assert not (tmp_path / "artifacts" / REQUEST).exists()


@pytest.mark.parametrize(
    ("from_step", "began"),
    [
        (21, [21]),  # the next step: exactly
        (18, [21]),  # three steps past: still the pair's steps, mostly
        (17, []),  # four steps past: the steps it wanted are gone
    ],
)
def test_a_request_for_steps_already_past_starts_at_once_or_is_dropped_as_stale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, from_step: int, began: list[int]
) -> None:
    clock = Clock()
    hooks = armed(tmp_path, clock, steps=3, poll_s=5)
    assert run_steps(hooks, range(1, 21), 0.1) == []
    (tmp_path / "artifacts" / REQUEST).write_text(json.dumps({"steps": 2, "from_step": from_step}))
    clock.now += 5
    assert run_steps(hooks, range(21, 30), 0.1) == began
    assert not (tmp_path / "artifacts" / REQUEST).exists()  # taken either way: it never asks again
    assert ("dropped as stale" in caplog.text) is (not began)


def test_a_slowdown_waits_for_the_steps_a_request_asked_for(tmp_path: Path) -> None:
    hooks = armed(tmp_path, steps=3)
    (tmp_path / "artifacts" / REQUEST).write_text(json.dumps({"steps": 2, "from_step": 25}))
    assert run_steps(hooks, range(1, 16), 0.1) == []
    # Slowed at 16 (tipped at 19): its own profile comes after the pair's steps, not into them.
    assert run_steps(hooks, range(16, 40), 0.13) == [25, 27]


def test_the_step_timings_say_where_requests_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    hooks = MedicHooks(JOB, "node-b", RANK, tmp_path / "events.jsonl", world_size=4, timings_every=2)
    hooks.step(1, 1.0, 0.1)
    [plain] = hooks.step(2, 1.0, 0.1)
    assert "artifacts_dir" not in plain.attributes  # no requests taken: nowhere to write one
    hooks.profile_on_demand("artifacts")  # relative here: the report says it in full
    hooks.step(3, 1.0, 0.1)
    [report] = hooks.step(4, 1.0, 0.1)
    parsed = FaultEvent.model_validate_json(report.to_json())
    assert parsed.attributes["artifacts_dir"] == str(Path("artifacts").absolute())


@pytest.mark.parametrize(
    "content", ["", "not json", '{"steps": 0}', f'{{"steps": {MAX_PROFILE_STEPS + 1}}}', "[]"]
)
def test_a_request_without_a_usable_step_count_gets_the_default(tmp_path: Path, content: str) -> None:
    hooks = armed(tmp_path, steps=4)
    (tmp_path / "artifacts" / REQUEST).write_text(content)
    request = hooks.profile_wanted()
    assert request is not None and request.steps == 4


@pytest.mark.parametrize(
    "options",
    [{"steps": 0}, {"steps": MAX_PROFILE_STEPS + 1}, {"poll_s": 0}, {"cooldown_s": -1}],
)
def test_bad_profile_options_fail_when_armed(tmp_path: Path, options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        armed(tmp_path, **options)


@pytest.mark.parametrize("rule", [{"ratio": 1.0}, {"min_history": 0}, {"history": 5, "min_history": 6}])
def test_a_slowdown_rule_that_cannot_work_is_refused(rule: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Slowdown(**rule)  # type: ignore[arg-type]


def test_the_job_takes_the_profile_asked_for_and_a_short_one_at_the_end(tmp_path: Path) -> None:
    hooks = armed(tmp_path, steps=3)
    (tmp_path / "artifacts" / REQUEST).write_text('{"steps": 5}')
    model = torch.nn.Linear(4, 1)
    with StepProfiler(hooks, torch.device("cpu")) as profiler:
        for step in (1, 2):  # training ends before the five steps asked for
            profiler.before(step)
            model(torch.randn(8, 4)).sum().backward()
            hooks.step(step, 1.0, 0.01)
            profiler.after(step)
    [report] = profiles(tmp_path)
    assert (report.attributes["first_step"], report.attributes["last_step"]) == (1, 2)
    trace = json.loads(Path(report.attributes["artifact"]).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names and any("addmm" in str(n) for n in names)
    assert list((tmp_path / "artifacts").iterdir()) == [Path(report.attributes["artifact"])]  # no .part


# --- The evidence names the files; a message links them (medic/artifacts.py) ----------------------


def test_the_evidence_names_each_file_once_and_says_what_it_is() -> None:
    profile = {"step_time_ratio": 1.3, "profile_event": "p-1", "artifact": "/shared/a/llm-r2-profile.json"}
    events = [
        fault_event("straggler", job=JOB, rank=2, node="node-b", attributes=profile),
        fault_event("straggler", job=JOB, rank=2, node="node-b", attributes=profile, seconds=10),
        fault_event(
            "nccl_timeout",
            job=JOB,
            rank=3,
            node="node-b",
            attributes={"stall_event": "s", "artifact": "/d.txt"},
        ),
        fault_event("xid"),
    ]
    assert artifacts_of(events) == (
        Artifact("profile of rank 2 on node-b", "/shared/a/llm-r2-profile.json"),
        Artifact("stack dump of rank 3 on node-b", "/d.txt"),
    )


@pytest.mark.parametrize(
    ("path", "url"),
    [
        (
            "/shared/medic/llm-r2-step16-profile.pt.trace.json",
            "https://files.example/m/llm-r2-step16-profile.pt.trace.json",
        ),
        ("/shared/medic/job 7/r#2.txt", "https://files.example/m/job%207/r%232.txt"),
        ("/shared/medic/../etc/passwd", None),  # `..` does not climb out of the root
        ("/shared/medicine/x.txt", None),  # a sibling that merely starts alike
        ("/shared/medic", None),
        ("medic-artifacts/x.txt", None),  # relative: to whose working directory?
    ],
)
def test_a_path_under_the_root_is_a_url_under_the_base(path: str, url: str | None) -> None:
    links = ArtifactLinks.from_env(
        {"MEDIC_ARTIFACT_ROOT": "/shared/medic/", "MEDIC_ARTIFACT_URL": "https://files.example/m/"}
    )
    assert links is not None and links.url(path) == url


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"MEDIC_ARTIFACT_ROOT": "/shared", "MEDIC_ARTIFACT_URL": "files.example/m"}, "MEDIC_ARTIFACT_URL"),
        ({"MEDIC_ARTIFACT_ROOT": "/shared", "MEDIC_ARTIFACT_URL": "https://x/a|b"}, "MEDIC_ARTIFACT_URL"),
        ({"MEDIC_ARTIFACT_ROOT": "shared", "MEDIC_ARTIFACT_URL": "https://x/"}, "MEDIC_ARTIFACT_ROOT"),
    ],
)
def test_a_malformed_link_setting_is_named(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ArtifactLinks.from_env(env)


def test_without_both_settings_paths_stay_paths() -> None:
    assert ArtifactLinks.from_env({"MEDIC_ARTIFACT_URL": "https://files.example/"}) is None
