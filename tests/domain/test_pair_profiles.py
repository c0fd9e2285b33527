"""A named straggler's pair of profiles (medic/pair_profiles.py), wired into the intake differential
(medic/culprit.py): what is asked for and when, how the two reports are matched, and how the diff's
verdict reaches the stragglers. The whole path in a real torchrun job is in
tests/system/test_profile_diff_jobs.py."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from checkout import REPO_ROOT
from factories import fault_event

from medic.culprit import Differential, differential
from medic.events import EventKind, FaultEvent
from medic.flows.job_signals import diff_pair, write_asks
from medic.flows.live import LiveDispatcher
from medic.integrations.registry import Backends
from medic.pair_profiles import COOLDOWN, PAIR_STEPS, VERDICT_WAIT, PairTraces, ProfileAsk, verdict_attributes
from medic.peers import TIMINGS_CHECK
from medic.profile_diff import Category, Cause, Growth, ProfileDiff, diagnose
from medic.profiles import PROFILE_CHECK
from medic.store import Store
from medic.tasks.runtime.process import Runtime, configure
from medic.training.medic_hooks import MedicHooks

JOB, WORLD, EVERY = "llm", 4, 10
NODE_OF = {rank: f"gpu-{rank // 2:03d}" for rank in range(WORLD)}  # 2 ranks a node
# The slow rank shares gpu-000 with rank 0; the peer asked is the first healthy rank on another node.
SLOW, PEER = 1, 2
STEP_S = 0.5  # the wall time of every rank's steps: they wait for each other
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "profiles"  # real traces (SOURCES.md there)


def folder(tmp_path: Path, rank: int) -> str:
    return str(tmp_path / NODE_OF[rank] / "artifacts")


def report(rank: int, iteration: int, at_s: float, **attributes: object) -> FaultEvent:
    """A health_check a rank's hooks send."""
    return fault_event(
        "health_check",
        node=NODE_OF[rank],
        gpu=rank % 2,
        job=JOB,
        rank=rank,
        iteration=iteration,
        seconds=at_s,
        source="job",
        attributes=attributes,
    )


def round_of(tmp_path: Path, first: int, at_s: float, dirs: bool = True) -> list[FaultEvent]:
    """Every rank's step-timings report of steps first..first+EVERY-1, rank SLOW's own work doubled."""
    return [
        report(
            rank,
            first + EVERY - 1,
            at_s,
            check=TIMINGS_CHECK,
            first_step=first,
            world_size=WORLD,
            step_times_s=[STEP_S] * EVERY,
            compute_s=[0.4 if rank == SLOW else 0.2] * EVERY,
            **({"artifacts_dir": folder(tmp_path, rank)} if dirs else {}),
        )
        for rank in range(WORLD)
    ]


def rounds(tmp_path: Path, first: int, count: int, at_s: float = 0.0, dirs: bool = True) -> list[FaultEvent]:
    return [
        e
        for n in range(count)
        for e in round_of(tmp_path, first + n * EVERY, at_s + n * EVERY * STEP_S, dirs)
    ]


def profile(
    rank: int, first: int, at_s: float, reason: str = "requested", artifact: Path | None = None
) -> FaultEvent:
    return report(
        rank,
        first + PAIR_STEPS - 1,
        at_s,
        check=PROFILE_CHECK,
        artifact=str(artifact or f"/traces/{JOB}-r{rank}-step{first}-profile.pt.trace.json"),
        reason=reason,
        first_step=first,
        last_step=first + PAIR_STEPS - 1,
    )


def push(diff: Differential, events: list[FaultEvent]) -> list[FaultEvent]:
    return [out for event in events for out in diff.push(event)]


def stragglers(events: list[FaultEvent]) -> list[FaultEvent]:
    return [e for e in events if e.kind is EventKind.STRAGGLER]


def python_diff(entries: int = 1) -> ProfileDiff:
    grown = [
        Growth(
            category=Category.PYTHON,
            name=f"train.py(42): hot_spot_{n}",
            suspect_s=0.009,
            peer_s=0.001,
            growth_s=0.008 - n * 0.001,
            ratio=9.0,
            confidence=0.97,
            significant=True,
        )
        for n in range(entries)
    ]
    return ProfileDiff(
        cause=Cause.SOFTWARE_PYTHON, confidence=0.97, reason="python +8 ms", steps=[60, 61], evidence=grown
    )


def test_a_named_straggler_and_a_peer_on_another_node_are_asked_for_the_same_steps(tmp_path: Path) -> None:
    diff = Differential(ask_profiles=True)
    assert not stragglers(push(diff, rounds(tmp_path, 1, 2)))  # named, and held for the pair's verdict
    [named, *_] = diff.pairs.pairs[JOB].waiting
    assert named.rank == SLOW
    suspect, peer = diff.pairs.take_asks()
    assert (suspect.rank, peer.rank) == (SLOW, PEER)
    # Named at the first round's end (step 10); two report windows past it (20 steps) and at least
    # 15 s of 0.5 s steps (30): the later.
    assert suspect.from_step == peer.from_step == 10 + 30
    assert suspect.path == Path(folder(tmp_path, SLOW)) / f"{JOB}-r{SLOW}.profile-request"
    assert json.loads(peer.body()) == {"steps": PAIR_STEPS, "from_step": 40}
    assert diff.pairs.take_asks() == []  # taken once


def test_one_pair_per_job_within_the_cooldown(tmp_path: Path) -> None:
    diff = Differential(ask_profiles=True)
    push(diff, rounds(tmp_path, 1, 2))
    assert len(diff.pairs.take_asks()) == 2
    assert not stragglers(push(diff, rounds(tmp_path, 21, 4, at_s=20)))  # still slow: held for the verdict
    assert diff.pairs.take_asks() == []
    later = COOLDOWN.total_seconds() + 60
    push(diff, rounds(tmp_path, 61, 1, at_s=later))
    assert [a.from_step for a in diff.pairs.take_asks()] == [70 + 30] * 2


def test_nothing_is_asked_of_ranks_whose_reports_name_no_directory(tmp_path: Path) -> None:
    diff = Differential(ask_profiles=True)
    assert stragglers(push(diff, rounds(tmp_path, 1, 2, dirs=False)))
    assert diff.pairs.take_asks() == []


def test_a_file_replayed_asks_for_nothing_and_its_stragglers_come_out_as_they_went_in(tmp_path: Path) -> None:
    out = differential(
        [*rounds(tmp_path, 1, 2), profile(SLOW, 40, 30), profile(PEER, 40, 30), *rounds(tmp_path, 61, 1, 40)]
    )
    assert stragglers(out) and not any("straggler_cause" in e.attributes for e in out)


def test_the_verdict_reaches_the_stragglers_about_the_suspect_once_both_profiles_are_diffed(
    tmp_path: Path,
) -> None:
    diff = Differential(ask_profiles=True)
    push(diff, rounds(tmp_path, 1, 2))
    diff.pairs.take_asks()
    push(diff, [profile(SLOW, 40, 30), profile(PEER, 31, 30, reason="slowdown")])
    assert diff.pairs.take_ready() == []  # the peer's own slowdown profile is not the one asked for
    push(diff, [profile(PEER, 42, 31)])  # the request read two steps late: still mostly the same steps
    [ready] = diff.pairs.take_ready()
    assert (ready.suspect_rank, ready.peer_rank, ready.peer.name) == (
        SLOW,
        PEER,
        f"{JOB}-r{PEER}-step42-profile.pt.trace.json",
    )
    assert not stragglers(push(diff, rounds(tmp_path, 61, 1, at_s=40)))  # held: not diffed yet
    diff.pairs.diagnosed(ready, python_diff())
    *released, carrying = stragglers(push(diff, rounds(tmp_path, 71, 1, at_s=45)))
    assert len(released) == 3  # the first two rounds' and round 61's: they waited, now with the verdict
    assert {e.attributes["straggler_cause"] for e in released} == {"software-python"}
    assert carrying.attributes["straggler_cause"] == "software-python"
    assert carrying.attributes["straggler_cause_hardware"] is False
    assert carrying.attributes["straggler_cause_where"] == "train.py(42): hot_spot_0"
    assert carrying.attributes["straggler_cause_peer_artifact"] == str(ready.peer)
    assert carrying.attributes["artifact"] == str(ready.suspect)  # its own trace, as every profile
    # Still valid as an event once stored and read back.
    assert FaultEvent.model_validate_json(carrying.model_dump_json()) == carrying
    later = COOLDOWN.total_seconds() + 90
    assert not stragglers(push(diff, rounds(tmp_path, 81, 1, at_s=later)))  # a new pair's, held
    assert len(diff.pairs.take_asks()) == 2  # the verdict is half an hour old: a new pair is asked


def test_a_straggler_waits_for_its_verdict_and_no_other_fault_does(tmp_path: Path) -> None:
    diff = Differential(ask_profiles=True)
    assert not stragglers(push(diff, rounds(tmp_path, 1, 2)))  # named, its pair asked: held
    xid = fault_event("xid", node=NODE_OF[SLOW], gpu=1, seconds=11, attributes={"code": 79})
    assert push(diff, [xid]) == [xid]  # the hardware names itself: never held
    asked_at = diff.pairs.pairs[JOB].asked_at
    assert diff.next_due() == asked_at + VERDICT_WAIT
    assert diff.due(asked_at + VERDICT_WAIT - timedelta(seconds=1)) == []


def test_without_a_verdict_in_time_the_held_stragglers_go_on_as_unknown_saying_why(tmp_path: Path) -> None:
    diff = Differential(ask_profiles=True)
    push(diff, rounds(tmp_path, 1, 2))
    push(diff, [profile(SLOW, 40, 30)])  # the suspect's profile came; the peer's never does
    asked_at = diff.pairs.pairs[JOB].asked_at
    late = stragglers(diff.due(asked_at + VERDICT_WAIT))
    assert late and {e.attributes["straggler_cause"] for e in late} == {"unknown"}  # decided as without one
    reason = f"no verdict: no profile from rank(s) {PEER} within 180 s"
    assert late[0].attributes["straggler_cause_reason"] == reason
    assert diff.next_due() is None
    # From then on its stragglers go on at once, and a verdict that comes late still reaches them.
    [now] = stragglers(push(diff, rounds(tmp_path, 201, 1, at_s=200)))
    assert now.attributes["straggler_cause"] == "unknown"


def test_the_end_of_a_file_lets_every_held_straggler_go(tmp_path: Path) -> None:
    diff = Differential(ask_profiles=True)
    push(diff, rounds(tmp_path, 1, 2))
    held = stragglers(diff.flush())
    assert held and not any("straggler_cause" in e.attributes for e in held)  # as if never asked


def test_the_evidence_is_the_diffs_top_five_entries() -> None:
    diff = python_diff(entries=7)
    operator = diff.evidence[1].model_copy(
        update={"category": Category.COMPUTE, "name": "aten::linear", "shapes": "[[32,16],[64,16],[64]]"}
    )
    diff = diff.model_copy(update={"evidence": [diff.evidence[0], operator, *diff.evidence[2:]]})
    attributes = verdict_attributes(diff, Path("/traces/peer.json"))
    evidence = attributes["straggler_cause_evidence"]
    assert isinstance(evidence, list) and len(evidence) == 5
    assert evidence[0] == {
        "name": "train.py(42): hot_spot_0",
        "category": "python",
        "grew_s": 0.008,
        "ratio": 9.0,
    }
    assert evidence[1]["name"] == "aten::linear [[32,16],[64,16],[64]]"  # an operator at its shapes
    assert set(attributes) == {
        "straggler_cause",
        "straggler_cause_confidence",
        "straggler_cause_hardware",
        "straggler_cause_where",
        "straggler_cause_reason",
        "straggler_cause_evidence",
        "straggler_cause_peer_artifact",
    }


def test_a_trace_that_cannot_be_read_gives_unknown_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "suspect.json").write_text("{not json")
    attributes = verdict_attributes(
        diagnose(tmp_path / "suspect.json", tmp_path / "gone.json"), tmp_path / "gone.json"
    )
    assert attributes["straggler_cause"] == "unknown" and attributes["straggler_cause_hardware"] is False
    assert "cannot read the trace" in str(attributes["straggler_cause_reason"])
    assert "straggler_cause_where" not in attributes


@pytest.mark.parametrize("rank", [SLOW, PEER])
def test_a_rank_s_hooks_take_the_request_as_written_at_its_step(tmp_path: Path, rank: int) -> None:
    ask = ProfileAsk(JOB, rank, folder(tmp_path, rank), PAIR_STEPS, from_step=7)
    hooks = MedicHooks(JOB, NODE_OF[rank], rank, tmp_path / "events.jsonl")
    hooks.profile_on_demand(ask.folder)
    ask.path.write_text(ask.body())
    began = []
    for step in range(1, 12):
        if (request := hooks.profile_wanted()) is not None:
            began.append((step, request.steps, request.reason))
        hooks.step(step, 1.0, 0.1)
    assert began == [(7, PAIR_STEPS, "requested")]


# --- The warm path of `medic serve` (medic/flows/live.py) -------------------------------------------------


def test_a_request_that_cannot_be_written_is_dropped_and_the_next_one_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nowhere = ProfileAsk(JOB, SLOW, str(tmp_path / "not-mounted"), PAIR_STEPS, 40)
    there = ProfileAsk(JOB, PEER, str(tmp_path), PAIR_STEPS, 40)
    write_asks([nowhere, there], tmp_path)
    assert f"could not ask llm rank {SLOW} for a profile" in caplog.text
    assert json.loads(there.path.read_text()) == {"steps": PAIR_STEPS, "from_step": 40}
    assert list(tmp_path.iterdir()) == [there.path]  # nothing half-written left beside it


def test_a_request_is_written_only_under_the_artifact_root(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The folder is the job's own word (its reports' `artifacts_dir`): never a place of its choosing.
    root, elsewhere = tmp_path / "jobs", tmp_path / "etc"
    elsewhere.mkdir()
    escape = ProfileAsk(JOB, SLOW, str(root / ".." / "etc"), PAIR_STEPS, 40)
    write_asks([escape, ProfileAsk(JOB, PEER, str(elsewhere), PAIR_STEPS, 40)], root)
    write_asks([ProfileAsk(JOB, PEER, str(elsewhere), PAIR_STEPS, 40)], None)
    assert list(elsewhere.iterdir()) == []
    assert caplog.text.count("is not under MEDIC_ARTIFACT_ROOT") == 3


def test_traces_outside_the_artifact_root_are_not_read(tmp_path: Path) -> None:
    outside = PairTraces(JOB, SLOW, PEER, Path("/etc/passwd"), tmp_path / "peer.json")
    diff = diff_pair(outside, tmp_path)
    assert (diff.cause, diff.reason) == (
        Cause.UNKNOWN,
        f"not read: /etc/passwd not under MEDIC_ARTIFACT_ROOT ({tmp_path})",
    )


def test_the_live_path_asks_for_the_pair_and_diffs_it_off_the_event_loop(
    tmp_path: Path,
    sqlite_store: Store,
    sim_backends: Backends,
    live_dispatcher: Callable[..., LiveDispatcher],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rt = configure(Runtime(sqlite_store, sim_backends, REPO_ROOT / "policies" / "default.yaml", tmp_path))
    dispatcher = live_dispatcher(rt)
    handed: list[FaultEvent] = []

    async def take(events: list[FaultEvent]) -> None:  # the differential's wiring, not the flows
        handed.extend(events)

    monkeypatch.setattr(dispatcher, "_take", take)
    for rank in range(WORLD):
        Path(folder(tmp_path, rank)).mkdir(parents=True, exist_ok=True)
    # Real traces of the reference job, rank 1 busy in a Python function, where the jobs write their
    # files: serve reads traces under MEDIC_ARTIFACT_ROOT only.
    suspect, peer = (
        Path(shutil.copy(FIXTURES / f"python-r{rank}.pt.trace.json.gz", tmp_path)) for rank in (1, 0)
    )

    async def serve() -> None:
        await dispatcher(rounds(tmp_path, 1, 2))
        for rank in (SLOW, PEER):
            request = Path(folder(tmp_path, rank)) / f"{JOB}-r{rank}.profile-request"
            assert json.loads(request.read_text()) == {"steps": PAIR_STEPS, "from_step": 40}
        await dispatcher([profile(SLOW, 40, 30, artifact=suspect), profile(PEER, 40, 30, artifact=peer)])
        await dispatcher.drain()  # the diff, on a worker thread
        handed.clear()
        await dispatcher(rounds(tmp_path, 61, 1, at_s=40))

    asyncio.run(serve())
    [straggler] = stragglers(handed)
    assert straggler.attributes["straggler_cause"] == "software-python"
    assert str(straggler.attributes["straggler_cause_where"]).endswith("injected_hot_spot")
    assert straggler.attributes["straggler_cause_peer_artifact"] == str(peer)
    assert rt.store.known_event_ids([straggler.id]) == {straggler.id}  # stored before it is correlated
