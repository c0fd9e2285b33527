"""The culprit, not the victim, in real torchrun jobs: 4 ranks on the CPU standing for 2 nodes.

Four launches of ~10-20 s each on 2 cores, each triaged with the default policy as `medic triage`
reads a file: (a) one rank twice as slow, (b) one rank hung before a collective, (c) every rank slower
together, (d) every rank stopped inside the same collective (stopped once its stalls are in). Ranks 0-1 are `node-a`, ranks 2-3 `node-b`. Each rank may profile itself (the job's
default: 3 steps once its own work slows), and the slow rank's trace is the deep look at it.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pytest
from checkout import REPO_ROOT
from torchrun_support import Run, kill_tree, launch, torchrun

from medic.artifacts import Artifact, artifacts_of
from medic.culprit import differential
from medic.events import EventKind, FaultEvent
from medic.intake import read_file
from medic.peers import TIMINGS_CHECK
from medic.policy import load_policy
from medic.policy.model import Action
from medic.profiles import PROFILE_CHECK
from medic.triage import Replayed, replay, stream
from medic.triage import read_file as read_streaming

pytestmark = pytest.mark.system

POLICY = load_policy(REPO_ROOT / "policies" / "default.yaml")
NODES = "node-a,node-a,node-b,node-b"
EVERY = 5  # steps per step-timings report
ONSET = 11  # the step the slowdown starts at
COMMON = (
    "--steps=40",
    "--ckpt-every=1000",  # no checkpoint: these runs are about timing
    f"--timings-every={EVERY}",
    f"--node-of-rank={NODES}",
    # Above the hooks' 20 ms floor for a slowdown (medic_hooks.Slowdown.min_step_s): at it, whether a
    # rank's own steps count as slowed turned on timer noise.
    "--step-work-s=0.03",
)
# Twice the work, well over the hooks' 1.2 (medic_hooks.Slowdown.ratio): with both cores loaded by the
# rest of the suite a rank's own step time carries milliseconds of scheduler noise, and at 1.3 that
# noise in the baseline alone could keep the slowed rank under the line.
SLOW_FACTOR = 2.0
HANG_RANK, HANG_AT = 3, 12


def hung_at(stall: FaultEvent) -> int:
    """Where the flight recorder says a stalled rank got to: the last collective it issued."""
    return int(stall.attributes["flight_recorder"]["last_enqueued_collective"])


def decided(run: Run) -> list[Replayed]:
    return list(replay(read_file(run.events).events, POLICY))


def acted_on(results: list[Replayed]) -> set[str]:
    return {r.incident.node for r in results if r.decision.action is not Action.NONE}


def profiles(run: Run) -> list[FaultEvent]:
    return [e for e in run.fault_events() if e.attributes.get("check") == PROFILE_CHECK]


@pytest.fixture(scope="module")
def slow_rank(tmp_path_factory: pytest.TempPathFactory) -> Run:
    faults = ("--slow-rank=2", f"--slow-factor={SLOW_FACTOR}", f"--slow-from-step={ONSET}")
    run = torchrun(tmp_path_factory.mktemp("slow-rank"), 4, *COMMON, *faults)
    assert run.returncode == 0, run.output
    return run


@pytest.fixture(scope="module")
def hung_rank(tmp_path_factory: pytest.TempPathFactory) -> Run:
    faults = (
        f"--hang-rank={HANG_RANK}",
        f"--hang-at-step={HANG_AT}",
        "--collective-timeout-s=3",
        "--stall-dump-s=1",  # well under the timeout: the hung rank reports before it is stopped
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCH_FR_BUFFER_SIZE", "100")  # PyTorch's flight recorder, on gloo too
        run = torchrun(tmp_path_factory.mktemp("hung-rank"), 4, *COMMON, *faults)
    assert run.returncode != 0  # the victims' timeouts end the job
    return run


@pytest.fixture(scope="module")
def slow_job(tmp_path_factory: pytest.TempPathFactory) -> Run:
    faults = ("--slow-all", f"--slow-factor={SLOW_FACTOR}", f"--slow-from-step={ONSET}")
    run = torchrun(tmp_path_factory.mktemp("slow-job"), 4, *COMMON, *faults)
    assert run.returncode == 0, run.output
    return run


def test_one_slow_rank_names_only_its_node(slow_rank: Run) -> None:
    raw = slow_rank.fault_events()
    assert {e.attributes["check"] for e in raw} == {TIMINGS_CHECK, PROFILE_CHECK}  # no rank named itself
    results = decided(slow_rank)
    assert acted_on(results) == {"node-b"}
    [incident] = [r for r in results if r.incident.node == "node-b"]
    assert incident.decision.rule == "sustained-straggler"
    stragglers = [e for e in incident.incident.events if e.kind is EventKind.STRAGGLER]
    assert {(e.rank, e.attributes["detector"]) for e in stragglers} == {(2, "peer")}
    assert all(e.attributes["step_time_ratio"] >= 1.2 for e in stragglers)
    assert all(e.iteration is not None and e.iteration >= ONSET for e in stragglers)


def test_the_slow_rank_alone_profiled_itself_and_its_incident_names_the_trace(slow_rank: Run) -> None:
    # The others waited for it in every step, but their own work did not slow: none profiled itself.
    [profile] = profiles(slow_rank)
    assert (profile.rank, profile.attributes["reason"]) == (2, "slowdown")
    first, last = profile.attributes["first_step"], profile.attributes["last_step"]
    assert first > ONSET and last - first + 1 == 3  # the job's default: the next 3 steps
    # Its own steps against its own past: about the factor, and never under the hooks' line.
    assert 1.2 <= profile.attributes["slowdown_ratio"] <= SLOW_FACTOR * 1.25
    path = profile.attributes["artifact"]
    trace = json.loads(Path(path).read_text())  # a Chrome trace, as chrome://tracing and Perfetto read it
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {f"ProfilerStep#{step}" for step in range(first, last + 1)} <= names
    assert any("linear" in str(name) for name in names)  # the model's own operators
    # The evidence of node-b's incident names the trace, and so does its message.
    [incident] = [r.incident for r in decided(slow_rank) if r.incident.node == "node-b"]
    stragglers = [e for e in incident.events if e.kind is EventKind.STRAGGLER]
    assert {(e.attributes["artifact"], e.attributes["profile_event"]) for e in stragglers} == {
        (path, profile.id)
    }
    assert artifacts_of(incident.events) == (Artifact("profile of rank 2 on node-b", path),)


def test_the_streaming_triage_finds_the_same_culprit(slow_rank: Run) -> None:
    with read_streaming(slow_rank.events) as reader:
        streamed = list(stream(reader.events(lambda rejection: None), POLICY))
    assert acted_on(streamed) == acted_on(decided(slow_rank)) == {"node-b"}


def test_a_hung_rank_is_named_and_the_reporters_are_victims(hung_rank: Run) -> None:
    timeouts = [e for e in hung_rank.fault_events() if e.kind is EventKind.NCCL_TIMEOUT]
    reporters = {e.rank for e in timeouts}
    assert reporters and HANG_RANK not in reporters  # it hung: only the victims could time out
    assert {e.attributes["collective_seq"] for e in timeouts} == {HANG_AT}
    # The flight recorder counts every collective of the group (broadcasts, barriers) alike on all.
    recorded = {e.attributes["flight_recorder"]["last_enqueued_collective"] for e in timeouts}
    assert len(recorded) == 1 and int(recorded.pop()) >= HANG_AT
    # Every rank stalled before the timeout; the hung one short of the collective the others are in.
    stalls = {e.rank: e for e in hung_rank.fault_events() if e.attributes.get("check") == "stall"}
    assert stalls[HANG_RANK].attributes["collective_seq"] == HANG_AT - 1
    assert {stalls[rank].attributes["collective_seq"] for rank in reporters if rank in stalls} <= {HANG_AT}

    results = decided(hung_rank)
    assert acted_on(results) == {"node-b"}
    [culprit] = [e for r in results for e in r.incident.events if e.kind is EventKind.NCCL_TIMEOUT]
    assert (culprit.rank, culprit.node, culprit.attributes["detector"]) == (HANG_RANK, "node-b", "hang")
    # Every report, the hung rank's stall too, carries the flight recorder: its numbering is compared.
    assert (culprit.attributes["evidence"], culprit.attributes["collective_seq"]) == (
        "behind",
        hung_at(stalls[HANG_RANK]),
    )
    assert culprit.attributes["collective_seq"] < culprit.attributes["peers_collective_seq"]
    assert {v["rank"] for v in culprit.attributes["victims"]} == reporters
    assert {v["node"] for v in culprit.attributes["victims"]} >= {"node-a"}
    # The deep look: the hung rank's own stacks, where it stopped.
    stacks = (hung_rank.events.parent / culprit.attributes["artifact"]).read_text()
    assert "time.sleep" in stacks or "in train" in stacks, stacks


def test_the_stalls_alone_name_the_hung_rank_before_any_timeout(hung_rank: Run) -> None:
    """What `medic serve` sees before the watchdog fires: the same run's events, its timeouts left out."""
    before = [e for e in hung_rank.fault_events() if e.kind is not EventKind.NCCL_TIMEOUT]
    [culprit] = [e for e in differential(before) if e.attributes.get("detector") == "hang"]
    attributes = culprit.attributes
    assert (culprit.rank, culprit.node, attributes["evidence"], attributes["before_timeout"]) == (
        HANG_RANK,
        "node-b",
        "behind",
        True,
    )
    [own] = [e for e in before if e.rank == HANG_RANK and e.attributes.get("check") == "stall"]
    assert attributes["collective_seq"] == hung_at(own) < attributes["peers_collective_seq"]
    assert {v["node"] for v in attributes["victims"]} >= {"node-a"}


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Every rank stops inside step 12's first collective and never comes back: no watchdog would end
    this run soon, so it is stopped once every rank has reported its stall."""
    process, run = launch(
        tmp_path_factory.mktemp("hung-job"), 4, *COMMON, f"--hang-all-at-step={HANG_AT}", "--stall-dump-s=1"
    )
    deadline = time.monotonic() + 120
    try:
        while len({e.rank for e in run.fault_events() if e.attributes.get("check") == "stall"}) < 4:
            assert time.monotonic() < deadline and process.poll() is None, "no stall from every rank"
            time.sleep(0.2)
    finally:
        kill_tree(process)
    return run


def test_every_rank_stopped_in_one_collective_is_a_hung_job_named_on_each_node(hung_job: Run) -> None:
    stalls = [e for e in hung_job.fault_events() if e.attributes.get("check") == "stall"]
    assert {(e.attributes["collective_seq"], e.attributes["in_collective"]) for e in stalls} == {
        (HANG_AT, True)
    }
    named = [e for e in differential(hung_job.fault_events()) if e.attributes.get("detector") == "hang"]
    assert [(e.node, e.attributes["ranks"], e.attributes["evidence"]) for e in named] == [
        ("node-a", [0, 1], "together"),
        ("node-b", [2, 3], "together"),
    ]
    assert all(e.attributes["before_timeout"] and e.job == "reference-train" for e in named)
    # The triage of the run: a collective timeout on each node, as the watchdog would have had it.
    assert acted_on(decided(hung_job)) == {"node-a", "node-b"}


def test_a_whole_job_slowing_blames_nobody(slow_job: Run) -> None:
    assert decided(slow_job) == []
    # Each rank's own work slowed, so each took one profile: the peers, not a rank alone, can tell
    # a slower job from a slower GPU. The profiles are telemetry: they opened no incident above.
    assert sorted(e.rank for e in profiles(slow_job)) == [0, 1, 2, 3]


def test_time_to_detect(slow_rank: Run) -> None:
    """From the slow rank's first slow step to the first peer verdict and to the policy's escalation."""
    results = decided(slow_rank)
    stragglers = sorted(
        (e for r in results for e in r.incident.events if e.kind is EventKind.STRAGGLER), key=lambda e: e.time
    )
    onset = _report_time(slow_rank.fault_events(), rank=2, iteration=ONSET - 1)
    first_s = (stragglers[0].time - onset).total_seconds()
    escalated_s = (stragglers[2].time - onset).total_seconds()  # sustained-straggler needs 3 reports
    assert 0 < first_s <= escalated_s < 60
    print(
        f"\ntime to detect: first verdict {first_s:.2f} s (step {stragglers[0].iteration}), "
        f"escalation {escalated_s:.2f} s (step {stragglers[2].iteration}) after step {ONSET} started"
    )


def _report_time(events: list[FaultEvent], *, rank: int, iteration: int) -> datetime:
    """When a rank reported the window ending at `iteration`: about when its next step began."""
    return next(e.time for e in events if e.rank == rank and e.iteration == iteration)
