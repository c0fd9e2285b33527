"""Hang attribution (medic/hangs.py): the rank that never entered the collective, not the reporters."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch._C._distributed_c10d as c10d
from checkout import REPO_ROOT
from factories import T0, fault_event
from sqlmodel import select

from medic.culprit import Differential, differential
from medic.events import EventKind, FaultEvent
from medic.flows.live import LiveDispatcher
from medic.hangs import attribute, flight_recorder_position
from medic.integrations.registry import Backends
from medic.peers import TIMINGS_CHECK
from medic.store import Store
from medic.store.tables import EventRecord
from medic.tasks.runtime.process import Runtime, configure
from medic.training.medic_hooks import MedicHooks

JOB, WORLD = "llm", 4
NODE_OF = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}


def seen(rank: int) -> FaultEvent:
    """An earlier report of the rank: how the job's ranks and their nodes are known."""
    attributes = {"check": TIMINGS_CHECK, "first_step": 1, "world_size": WORLD, "step_times_s": [1.0]}
    return fault_event("health_check", job=JOB, rank=rank, node=NODE_OF[rank], attributes=attributes)


def timeout(rank: int, seq: int | None, seconds: float = 60, **attributes: object) -> FaultEvent:
    if seq is not None:
        attributes["collective_seq"] = seq
    return fault_event(
        "nccl_timeout",
        job=JOB,
        rank=rank,
        node=NODE_OF[rank],
        seconds=seconds,
        iteration=11,
        attributes={"world_size": WORLD, **attributes},
    )


def members() -> list[FaultEvent]:
    return [seen(rank) for rank in range(WORLD)]


def test_the_silent_rank_is_the_culprit_and_the_reporters_its_victims() -> None:
    reporters = [timeout(rank, 12, seconds=60 + rank) for rank in (0, 1, 2)]
    [culprit] = differential([*members(), *reporters])
    assert (culprit.kind, culprit.node, culprit.rank, culprit.source) == (
        EventKind.NCCL_TIMEOUT,
        "node-b",
        3,
        "medic",
    )
    attributes = culprit.attributes
    assert (attributes["detector"], attributes["evidence"]) == ("hang", "absent")
    assert attributes["peers_collective_seq"] == 12 and "collective_seq" not in attributes  # it never said
    assert [v["rank"] for v in attributes["victims"]] == [0, 1, 2]
    assert [v["event"] for v in attributes["victims"]] == [e.id for e in reporters]
    assert attributes["confidence"] == 0.6  # 0.8 x 3 of 4 ranks reported
    assert culprit.iteration == 11 and culprit.time == reporters[-1].time


def test_the_reporters_timeouts_are_explained_by_their_culprit_and_nothing_else_is() -> None:
    """Absorbed, they are in no incident: the pairs let the store mark them, so that a restart does
    not hand them on again, with no culprit to absorb them, as a timeout on every victim's node."""
    diff = Differential()
    reporters = [timeout(rank, 12, seconds=60 + rank) for rank in (0, 1, 2)]
    [culprit] = [out for event in [*members(), *reporters] for out in diff.push(event)] + diff.flush()
    assert diff.take_explained() == [(r.id, culprit.id) for r in reporters]
    assert diff.take_explained() == []  # taken once
    stuck = [timeout(rank, 12) for rank in range(WORLD)]  # no rank to blame: each goes on, unexplained
    assert [out for event in stuck for out in diff.push(event)] + diff.flush() == stuck
    assert diff.take_explained() == []


def test_a_rank_behind_the_others_is_the_culprit_even_when_it_reported() -> None:
    reports = [timeout(0, 12), timeout(1, 12), timeout(2, 12), timeout(3, 11)]
    [culprit] = differential([*members(), *reports])
    assert (culprit.rank, culprit.attributes["evidence"], culprit.attributes["collective_seq"]) == (
        3,
        "behind",
        11,
    )
    assert culprit.attributes["confidence"] == 0.75
    assert culprit.attributes["victim_count"] == 3


def test_everyone_stuck_at_the_same_collective_is_no_one_rank_s_fault() -> None:
    reports = [timeout(rank, 12) for rank in range(WORLD)]
    assert differential([*members(), *reports]) == [*reports]


def test_too_many_silent_ranks_single_out_nobody() -> None:
    reports = [timeout(0, 12), timeout(1, 12)]
    assert differential([*members(), *reports]) == reports


def test_a_culprit_never_seen_before_cannot_be_placed() -> None:
    reports = [timeout(rank, 12) for rank in (0, 1, 2)]
    assert differential([seen(0), seen(1), seen(2), *reports]) == reports


def test_timeouts_that_do_not_say_where_they_were_pass_unheld() -> None:
    plain = [timeout(rank, None) for rank in (0, 1, 2)]
    assert differential([*members(), *plain]) == plain


def test_reports_are_held_until_they_settle_then_released_by_later_events() -> None:
    diff = Differential(settle=timedelta(seconds=30))
    for event in members():
        assert diff.push(event) == []
    assert diff.push(timeout(0, 12, seconds=60)) == []
    assert diff.push(timeout(1, 12, seconds=61)) == []
    assert diff.push(timeout(2, 12, seconds=62)) == []
    assert diff.due(T0 + timedelta(seconds=89)) == []
    later = fault_event("xid", node="node-c", seconds=95)
    [culprit, xid] = diff.push(later)
    assert (culprit.rank, xid) == (3, later)
    assert diff.flush() == []


def test_the_flight_recorder_s_position_wins_over_the_hook_s_count() -> None:
    # The hooks counted the same collectives everywhere; rank 2's GPU never started the 40th.
    def recorded(rank: int) -> dict[str, str]:
        started = "39" if rank == 2 else "40"
        return {"last_enqueued_collective": "40", "last_started_collective": started}

    reports = [timeout(rank, 12, flight_recorder=recorded(rank)) for rank in range(WORLD)]
    [culprit] = differential([*members(), *reports])
    assert (culprit.rank, culprit.attributes["collective_seq"]) == (2, 39)


def test_numberings_are_never_mixed() -> None:
    # Victims with the flight recorder's count (all collectives), a silent rank's stall report with
    # the hooks' (only those the loop reported): the hooks' count is compared, in one numbering.
    fr = {"last_enqueued_collective": "57"}
    reports = [timeout(rank, 12, flight_recorder=fr) for rank in (0, 1, 2)]
    [culprit] = differential([*members(), stall(3, 11), *reports])
    assert (culprit.attributes["collective_seq"], culprit.attributes["peers_collective_seq"]) == (11, 12)


def stall(rank: int, seq: int, seconds: float = 55) -> FaultEvent:
    return fault_event(
        "health_check",
        job=JOB,
        rank=rank,
        node=NODE_OF[rank],
        seconds=seconds,
        attributes={"check": "stall", "collective_seq": seq, "artifact": f"/dumps/r{rank}.txt"},
    )


def test_a_silent_rank_s_own_stall_report_places_it_and_brings_its_stacks() -> None:
    reporters = [timeout(rank, 12) for rank in (0, 1, 2)]
    [culprit] = differential([*members(), stall(0, 12), stall(3, 11), *reporters])
    attributes = culprit.attributes
    assert (culprit.rank, attributes["evidence"], attributes["collective_seq"]) == (3, "behind", 11)
    assert attributes["artifact"] == "/dumps/r3.txt"
    assert attributes["confidence"] == 0.75


def test_a_stall_long_before_the_timeouts_is_no_evidence() -> None:
    reporters = [timeout(rank, 12) for rank in (0, 1, 2)]
    [culprit] = differential([*members(), stall(3, 11, seconds=-3600), *reporters])
    assert culprit.attributes["evidence"] == "absent" and "artifact" not in culprit.attributes


def test_stalls_alone_name_the_rank_behind_before_any_timeout() -> None:
    """Every rank of a hung job stalls; the one short of its peers' collective is named once the
    stalls settle (15 s after the first), minutes before PyTorch's watchdog would time out."""
    diff = Differential()
    for event in members():
        assert diff.push(event) == []
    stalls = [stall(0, 12, 30), stall(1, 12, 31), stall(3, 11, 33), stall(2, 12, 36)]
    assert [e for s in stalls for e in diff.push(s)] == []
    assert diff.due(T0 + timedelta(seconds=44)) == []  # the first stall + 15 s, not yet
    [culprit] = diff.due(T0 + timedelta(seconds=45))
    attributes = culprit.attributes
    assert (culprit.rank, culprit.node, attributes["evidence"], attributes["before_timeout"]) == (
        3,
        "node-b",
        "behind",
        True,
    )
    assert (attributes["collective_seq"], attributes["peers_collective_seq"]) == (11, 12)
    assert [v["rank"] for v in attributes["victims"]] == [0, 1, 2]  # the stalled peers waiting for it
    assert attributes["artifact"] == "/dumps/r3.txt" and culprit.time == stalls[-1].time
    # The watchdog's timeouts later name the same culprit, under the same id: one event, not two.
    later = [timeout(rank, 12, seconds=600 + rank) for rank in (0, 1, 2)]
    assert [e for t in later for e in diff.push(t)] == []
    [again] = diff.flush()
    assert (again.id, again.attributes["evidence"]) == (culprit.id, "behind")


def test_ranks_stalled_at_the_same_place_name_nobody() -> None:
    # A checkpoint every rank writes, or a slow input pipeline: all wait alike, and no event comes.
    together = [stall(rank, 12, 30 + rank) for rank in range(WORLD)]
    assert differential([*members(), *together]) == []


def waiting(rank: int, seq: int = 12, seconds: float = 30, **attributes: object) -> FaultEvent:
    """A stall report from a rank waiting inside its collective, as the hooks send it."""
    event = stall(rank, seq, seconds)
    extra = {"world_size": WORLD, "in_collective": True, **attributes}
    return event.model_copy(update={"attributes": {**event.attributes, **extra}})


def test_every_rank_waiting_inside_the_same_collective_is_a_hung_job_named_node_by_node() -> None:
    """A link or a switch between the ranks: every one entered the collective and none comes back.
    No rank is behind, but the job is hung: named once the stalls settle, not at the watchdog."""
    diff = Differential()
    for event in members():
        diff.push(event)
    for rank in range(WORLD):
        assert diff.push(waiting(rank, seconds=30 + rank)) == []
    assert diff.due(T0 + timedelta(seconds=44)) == []
    named = diff.due(T0 + timedelta(seconds=45))
    assert [(e.node, e.rank, e.attributes["ranks"]) for e in named] == [
        ("node-a", 0, [0, 1]),
        ("node-b", 2, [2, 3]),
    ]
    for event in named:
        assert event.kind is EventKind.NCCL_TIMEOUT and event.gpu is None  # two GPUs of the node wait
        attributes = event.attributes
        assert (attributes["evidence"], attributes["before_timeout"], attributes["collective_seq"]) == (
            "together",
            True,
            12,
        )
        assert (attributes["world_size"], attributes["nodes"], attributes["reports"]) == (WORLD, 2, WORLD)
        assert "victims" not in attributes  # nobody's victim: no rank is singled out
    assert named[0].attributes["artifact"] == "/dumps/r0.txt"
    # The same stalls again (a replay, another replica) give the same ids.
    again = differential([*members(), *(waiting(rank, seconds=30 + rank) for rank in range(WORLD))])
    assert [e.id for e in again] == [e.id for e in named]


@pytest.mark.parametrize(
    "reports",
    [
        [waiting(rank, in_collective=rank != 2) for rank in range(WORLD)],  # one at its own work
        [waiting(rank) for rank in range(WORLD - 1)],  # one never reported: it may be the one behind
        [waiting(rank, world_size=None) for rank in range(WORLD)],  # the job's size unknown
        [waiting(rank, in_collective=None) for rank in range(WORLD)],  # hooks too old to say
        # The flight recorder saw collective 12 complete: whatever they wait on, it is no collective.
        [
            waiting(rank, flight_recorder={"last_enqueued_collective": 12, "last_completed_collective": 12})
            for rank in range(WORLD)
        ],
    ],
    ids=["one outside", "one silent", "size unknown", "inside unknown", "recorder: completed"],
)
def test_a_hung_job_is_named_only_when_every_rank_is_known_to_wait_inside(reports: list[FaultEvent]) -> None:
    assert differential([*members(), *reports]) == []


def test_the_flight_recorder_says_a_rank_waits_inside_where_the_hooks_cannot() -> None:
    recorder = {
        "last_enqueued_collective": 40,
        "last_started_collective": 40,
        "last_completed_collective": 39,
    }
    stalls = [waiting(rank, in_collective=None, flight_recorder=recorder) for rank in range(WORLD)]
    assert [e.attributes["collective_seq"] for e in differential([*members(), *stalls])] == [40, 40]


def test_a_job_that_moves_while_its_stalls_gather_is_slow_not_hung() -> None:
    # Every step slower than the watch's period: the ranks stall at each step, a step apart at times.
    stepping = [stall(0, 12, 30), stall(1, 12, 30), stall(2, 12, 31), stall(3, 11, 31), stall(0, 13, 32)]
    assert differential([*members(), *stepping]) == []
    # Or a rank's step timings come in while they gather.
    timings = seen(1).model_copy(update={"time": T0 + timedelta(seconds=35)})
    assert differential([*members(), *stepping[:4], timings]) == []


def test_a_rank_silent_among_stalled_peers_is_left_for_the_timeout() -> None:
    # Rank 3 may only be late to report: stalls alone never call a silence a hang.
    assert differential([*members(), *(stall(rank, 12, 30) for rank in (0, 1, 2))]) == []
    assert differential([*members(), stall(2, 11, 30)]) == []  # one rank alone is behind nobody


@pytest.mark.parametrize(
    ("positions", "world", "expected"),
    [
        ({0: 5, 1: 5, 2: 4}, 3, [(2, "behind")]),
        ({0: 5, 1: 4, 2: 4, 3: 5}, 4, [(1, "behind"), (2, "behind")]),
        ({0: 5, 1: 5, 2: 5}, 4, [(3, "absent")]),
        ({0: 5, 1: 5}, 4, []),
        ({}, 4, []),
    ],
    ids=["one behind", "two behind", "one absent", "half absent", "no reports"],
)
def test_attribute(positions: dict[int, int], world: int, expected: list[tuple[int, str]]) -> None:
    found = attribute(positions, world, set(range(world)))
    assert [(c.rank, c.evidence) for c in found] == expected


# A gloo flight recorder dump (`torch._C._distributed_c10d._dump_fr_trace_json()`, torch 2.13,
# TORCH_FR_BUFFER_SIZE=100) of two ranks in one process: the rank of group 0 issued two all-reduces,
# the rank of group 1 three (the third timed out). Trimmed to the keys read here.
GLOO_DUMP = {
    "version": "2.10",
    "pg_status": {
        "0": {
            "last_completed_collective": "2",
            "last_enqueued_collective": "2",
            "last_started_collective": "-1",
        },
        "1": {
            "last_completed_collective": "3",
            "last_enqueued_collective": "3",
            "last_started_collective": "-1",
        },
    },
    "entries": [
        {
            "record_id": 0,
            "pg_id": 1,
            "collective_seq_id": 1,
            "p2p_seq_id": 0,
            "is_p2p": False,
            "state": "scheduled",
        },
        {
            "record_id": 1,
            "pg_id": 0,
            "collective_seq_id": 1,
            "p2p_seq_id": 0,
            "is_p2p": False,
            "state": "scheduled",
        },
        {
            "record_id": 2,
            "pg_id": 1,
            "collective_seq_id": 2,
            "p2p_seq_id": 0,
            "is_p2p": False,
            "state": "scheduled",
        },
        {
            "record_id": 3,
            "pg_id": 0,
            "collective_seq_id": 2,
            "p2p_seq_id": 0,
            "is_p2p": False,
            "state": "scheduled",
        },
        {
            "record_id": 4,
            "pg_id": 1,
            "collective_seq_id": 3,
            "p2p_seq_id": 0,
            "is_p2p": False,
            "state": "scheduled",
        },
    ],
}


def test_flight_recorder_position_reads_pg_status() -> None:
    zero, one = flight_recorder_position(GLOO_DUMP), flight_recorder_position(GLOO_DUMP, pg="1")
    assert zero is not None and one is not None
    assert (zero.position(), one.position()) == (2, 3)  # gloo tracks no start: issued is the position
    assert zero.last_completed_collective == 2


def test_flight_recorder_position_falls_back_to_the_entries() -> None:
    entries = [
        *GLOO_DUMP["entries"],  # type: ignore[misc]
        {"pg_id": 0, "collective_seq_id": 3, "is_p2p": False, "state": "started"},
        {"pg_id": 0, "collective_seq_id": 9, "is_p2p": True, "state": "completed"},
    ]
    position = flight_recorder_position({"entries": entries})
    assert position is not None
    assert (position.last_enqueued_collective, position.last_started_collective) == (3, 3)
    assert position.last_completed_collective == -1 and position.position() == 3
    assert flight_recorder_position({"entries": "junk"}) is None
    assert flight_recorder_position({"entries": entries}, pg="7") is None


# --- The hooks' side: where a rank was when its collective timed out ----------------------------


def test_the_hooks_timeout_says_which_collective_the_rank_was_in(tmp_path: Path) -> None:
    sink = tmp_path / "events.jsonl"
    hooks = MedicHooks(job=JOB, node="node-a", rank=0, sink=sink, world_size=WORLD)
    for step in range(1, 4):
        hooks.collective()
        hooks.step(step, 1.0, 0.1)
    hooks.collective()  # entered step 4's and never came back
    with pytest.raises(RuntimeError), hooks.watch():
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    [event] = [FaultEvent.model_validate_json(line) for line in sink.read_text().splitlines()]
    assert event.kind is EventKind.NCCL_TIMEOUT
    assert (event.attributes["collective_seq"], event.attributes["world_size"], event.iteration) == (
        4,
        WORLD,
        3,
    )


def test_a_stalled_rank_dumps_its_stacks_and_reports_where_it_stopped(tmp_path: Path) -> None:
    sink = tmp_path / "events.jsonl"
    hooks = MedicHooks(job=JOB, node="node-b", rank=3, sink=sink, world_size=WORLD)
    hooks.collective()
    hooks.step(1, 1.0, 0.1)
    hooks.watch_for_stalls(0.2, tmp_path / "dumps")
    deadline = time.monotonic() + 10
    while not sink.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # this thread is "hung"; the watch sees no step end
    time.sleep(0.3)  # one report per stalled step, however long it stalls
    [event] = [FaultEvent.model_validate_json(line) for line in sink.read_text().splitlines()]
    assert (event.kind, event.attributes["check"], event.iteration) == (EventKind.HEALTH_CHECK, "stall", 1)
    assert event.attributes["collective_seq"] == 1 and event.attributes["stalled_s"] >= 0.2
    assert event.attributes["in_collective"] is False  # its step ended: stalled at its own work
    stacks = Path(event.attributes["artifact"]).read_text()
    assert "test_a_stalled_rank_dumps_its_stacks" in stacks  # this very frame, where it "hung"


def test_a_loop_that_reports_no_collectives_sends_no_position(tmp_path: Path) -> None:
    sink = tmp_path / "events.jsonl"
    hooks = MedicHooks(job=JOB, node="node-a", rank=0, sink=sink)
    event = hooks.report_exception(RuntimeError("timed out"))
    assert event is not None and "collective_seq" not in event.attributes
    assert differential([FaultEvent.model_validate_json(event.to_json())])[0].id == event.id


# --- The warm path of `medic serve` (medic/flows/live.py) -------------------------------------------------

LIVE_NODE_OF = {rank: f"gpu-node-{rank + 1}" for rank in range(WORLD)}  # the simulated fleet's


def handing_on(dispatcher: LiveDispatcher) -> list[FaultEvent]:
    """What the dispatcher hands on to correlation and flow runs, kept instead."""
    handed: list[FaultEvent] = []

    async def take(events: list[FaultEvent]) -> None:
        handed.extend(events)

    dispatcher._take = take  # type: ignore[method-assign]  # the differential's wiring, not the flows
    return handed


def on_the_fleet(event: FaultEvent, at: datetime) -> FaultEvent:
    assert event.rank is not None
    return event.model_copy(update={"node": LIVE_NODE_OF[event.rank], "time": at})


def known_ranks(now: datetime) -> list[FaultEvent]:
    return [on_the_fleet(seen(rank), now - timedelta(minutes=1)) for rank in range(WORLD)]


def test_the_live_path_stores_and_hands_on_the_culprit_once_the_reports_settle(
    sqlite_store: Store, sim_backends: Backends, live_dispatcher: Callable[..., LiveDispatcher]
) -> None:
    rt = configure(Runtime(sqlite_store, sim_backends, REPO_ROOT / "policies" / "default.yaml"))
    dispatcher = live_dispatcher(rt)
    dispatcher.signals.differential = Differential(settle=timedelta(seconds=0.5))
    handed = handing_on(dispatcher)
    now = datetime.now(UTC)
    known = known_ranks(now)
    reports = [on_the_fleet(timeout(rank, 12), now) for rank in (0, 1, 2)]
    rt.store.record_accepted([*known, *reports])  # as `medic serve` stores before handing on

    async def serve() -> None:
        await dispatcher([*known, *reports])
        assert handed == []  # held: the reports are settling
        await dispatcher.drain()

    asyncio.run(serve())
    [culprit] = handed
    assert (culprit.node, culprit.rank, culprit.switch) == (
        "gpu-node-4",
        3,
        "leaf-1",
    )  # placed from the fleet
    assert rt.store.known_event_ids([culprit.id]) == {culprit.id}  # stored before it is correlated
    # The victims' timeouts are its evidence, and the ranks' step timings live reports: a start
    # hands on none of them again.
    assert {e.id for e in rt.store.undispatched_events()}.isdisjoint(e.id for e in [*known, *reports])
    with sqlite_store.session() as s:
        explained = dict(s.exec(select(EventRecord.id, EventRecord.explained_by)).all())
    assert [explained[r.id] for r in reports] == [culprit.id] * 3


def test_the_live_path_gathers_stalls_for_the_policy_s_stall_settle_seconds(
    tmp_path: Path,
    sqlite_store: Store,
    sim_backends: Backends,
    live_dispatcher: Callable[..., LiveDispatcher],
) -> None:
    policy = tmp_path / "policy.yaml"
    default = (REPO_ROOT / "policies" / "default.yaml").read_text()
    policy.write_text(default.replace("\ndefaults:\n", "\ndefaults:\n  stall_settle_seconds: 1\n", 1))
    rt = configure(Runtime(sqlite_store, sim_backends, policy))
    dispatcher = live_dispatcher(rt)
    handed = handing_on(dispatcher)
    now = datetime.now(UTC)
    known = known_ranks(now)
    stalls = [on_the_fleet(stall(rank, 11 if rank == 3 else 12), now) for rank in range(WORLD)]
    rt.store.record_accepted([*known, *stalls])

    async def serve() -> float:
        started = time.monotonic()
        await dispatcher([*known, *stalls])
        assert handed == []  # gathering: the policy's second has not passed
        await dispatcher.drain()
        return time.monotonic() - started

    took = asyncio.run(serve())
    [culprit] = handed
    assert (culprit.rank, culprit.node, culprit.attributes["before_timeout"]) == (3, "gpu-node-4", True)
    assert dispatcher.signals.differential.hangs.stall_settle == timedelta(seconds=1)
    assert took < 10  # the policy's 1 s, not the default 15 s


# What torch 2.11's two dumps answered on an NVIDIA H200 for one NCCL rank after three all-reduces
# (docs/gpu-run.md, 2026-11-28): the generic dump knew no group, the NCCL dump did (its first entry of three).
H200_NCCL_FR_DUMP = {
    "pg_status": {
        "0": {
            "last_completed_collective": "-1",
            "last_enqueued_collective": "3",
            "last_started_collective": "-1",
        }
    },
    "entries": [
        {
            "collective_seq_id": 1,
            "input_dtypes": ["Float"],
            "input_sizes": [[4]],
            "is_p2p": False,
            "op_id": 1,
            "output_dtypes": ["Float"],
            "output_sizes": [[4]],
            "p2p_seq_id": 0,
            "pg_id": 0,
            "process_group": ["0", "default_pg"],
            "profiling_name": "nccl:all_reduce",
            "record_id": 0,
            "retired": False,
            "state": "completed",
            "timeout_ms": 600000,
        }
    ],
}
H200_GENERIC_FR_DUMP: dict[str, object] = {"pg_status": {}}


def test_an_nccl_group_s_place_comes_from_the_nccl_dump_when_the_generic_one_knows_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda: json.dumps(H200_GENERIC_FR_DUMP), raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda: json.dumps(H200_NCCL_FR_DUMP), raising=False)
    hooks = MedicHooks(job=JOB, node="node-a", rank=0, sink=tmp_path / "events.jsonl", world_size=WORLD)
    event = hooks.report_exception(RuntimeError("Watchdog caught collective operation timeout"))
    assert event is not None
    assert event.attributes["flight_recorder"] == H200_NCCL_FR_DUMP["pg_status"]["0"]  # type: ignore[index]


def test_the_hooks_timeout_carries_the_flight_recorder_s_place_where_there_is_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda: json.dumps(GLOO_DUMP), raising=False)
    hooks = MedicHooks(job=JOB, node="node-a", rank=0, sink=tmp_path / "events.jsonl", world_size=WORLD)
    event = hooks.report_exception(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    assert event is not None
    assert event.attributes["flight_recorder"] == GLOO_DUMP["pg_status"]["0"]  # type: ignore[index]
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # off: the dump is not even asked for
    event = hooks.report_exception(RuntimeError("timed out"))
    assert event is not None and "flight_recorder" not in event.attributes
