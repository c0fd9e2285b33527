"""`medic policy replay` at scale: in two processes (medic/apps/cli/replay_parallel.py), the report one replay
in one process makes, whether the halves stand for it or the replay is made again whole; and in one
process, the report the cluster's every event would give, from a context of the kinds the policy counts."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from bench.replay import fill
from checkout import REPO_ROOT
from forks_support import assert_helper_ends_with_its_parent
from sqlalchemy import func, select, text, update
from sqlmodel import col

import medic.apps.cli.replay_parallel as parallel
from medic.events import EventKind
from medic.policy import LoadedPolicy, load_policy
from medic.policy.model import Action, Policy
from medic.store import Store
from medic.store.tables import DecisionRecord, IncidentRecord
from medic.whatif.replay import History, Redeciding, decided_as_one, replay
from medic.whatif.replay_report import Judge, Outcome, Redecided, Redecisions, ReplayReport, judge

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """600 incidents over 90 days, two decisions each with their facts, as `bench.replay` fills a store."""
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('halves') / 'medic.db'}")
    fill(store, load_policy(DEFAULT_POLICY), 600)
    yield store
    store.close()


def edited(directory: Path, old: str, new: str) -> LoadedPolicy:
    path = directory / "new.yaml"
    policy = DEFAULT_POLICY.read_text()
    assert old in policy, old
    path.write_text(policy.replace(old, new, 1))
    return load_policy(path)


REBOOT = "      xid: [79]\n    then:\n      classification: hardware\n      action: reboot\n"
EDITS = {
    "the default policy": None,
    "XID 79 replaces the node": (REBOOT, REBOOT.replace("reboot", "replace")),
    # Three nodes out at most: nodes the earlier half's decisions leave out stop the later half's.
    "three nodes out at most": ("max_out_of_service_percent: 10", "max_out_of_service: 3"),
}


@pytest.fixture
def whole(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the replays made whole, in one process."""
    made: list[int] = []

    def counted(history: History, loaded: LoadedPolicy, since: datetime | None = None) -> ReplayReport:
        made.append(1)
        return replay(history, loaded, since)

    monkeypatch.setattr(parallel, "replay", counted)
    return made


def in_one_process(store: Store, loaded: LoadedPolicy, since: datetime | None = None) -> ReplayReport:
    return replay(store.replay_history(since=since, lookback=loaded.policy.lookback()), loaded, since)


@pytest.mark.parametrize("edit", EDITS)
def test_two_halves_report_what_one_replay_does(
    filled: Store, tmp_path: Path, whole: list[int], monkeypatch: pytest.MonkeyPatch, edit: str
) -> None:
    monkeypatch.setattr(parallel, "HANDFUL", 7)  # handed over and judged a few at a time
    change = EDITS[edit]
    loaded = edited(tmp_path, *change) if change else load_policy(DEFAULT_POLICY)
    report = parallel.replay_store(filled, loaded, None, parallel_from=0)
    assert whole == []  # the halves stood for the replay
    assert report == in_one_process(filled, loaded)
    assert report.incidents == 600
    assert (report.changed > 0) is (change is not None)
    assert bool(report.guardrails) is (edit == "three nodes out at most")


def test_since_splits_the_incidents_it_keeps(filled: Store, whole: list[int]) -> None:
    loaded = load_policy(DEFAULT_POLICY)
    since = datetime(2026, 11, 1, tzinfo=UTC)
    report = parallel.replay_store(filled, loaded, since, parallel_from=0)
    assert whole == []
    assert report == in_one_process(filled, loaded, since)
    assert 0 < report.incidents < 600


def test_below_the_threshold_one_process_replays(filled: Store, whole: list[int]) -> None:
    loaded = load_policy(DEFAULT_POLICY)
    assert parallel.replay_store(filled, loaded, None) == in_one_process(filled, loaded)
    assert whole == [1]


def test_a_context_of_the_kinds_the_policy_counts_decides_as_every_event_does(
    filled: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = load_policy(DEFAULT_POLICY)
    assert loaded.policy.context_kinds() == {
        EventKind.XID,
        EventKind.ECC,
        EventKind.GPU_MISSING,
        EventKind.NODE_UNREACHABLE,
        EventKind.NAN_LOSS,
        EventKind.JOB_CRASH,
        EventKind.NCCL_TIMEOUT,
    }
    counted = in_one_process(filled, loaded)
    monkeypatch.setattr(Policy, "context_kinds", lambda self: frozenset(EventKind))
    assert in_one_process(filled, loaded) == counted


def test_facts_rebuilt_make_the_replay_whole(tmp_path: Path, whole: list[int]) -> None:
    # Rebuilt facts read the node's history from where the half's history starts, not the whole's.
    store = Store(f"sqlite:///{tmp_path / 'medic.db'}")
    fill(store, load_policy(DEFAULT_POLICY), 100)
    with store.engine.begin() as connection:
        connection.execute(text("UPDATE decisions SET facts = NULL WHERE id % 3 = 0"))
    loaded = load_policy(DEFAULT_POLICY)
    report = parallel.replay_store(store, loaded, None, parallel_from=0)
    assert whole == [1]
    assert report == in_one_process(store, loaded)
    assert report.rebuilt > 0
    store.close()


def test_a_part_that_fails_leaves_the_replay_to_this_process(
    filled: Store, whole: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It fails after handing some of its decisions over: what this process judged of them is thrown away.
    parent = os.getpid()

    class FailsInTheChild(Redeciding):
        def __iter__(self) -> Iterator[Redecided]:
            for made, decided in enumerate(super().__iter__()):
                if made == 5 and os.getpid() != parent:
                    raise RuntimeError("the later part's process fails")
                yield decided

    monkeypatch.setattr(parallel, "Redeciding", FailsInTheChild)
    monkeypatch.setattr(parallel, "HANDFUL", 2)
    loaded = load_policy(DEFAULT_POLICY)
    assert parallel.replay_store(filled, loaded, None, parallel_from=0) == in_one_process(filled, loaded)
    assert whole == [1]


@pytest.mark.parametrize("moved", ["earlier after the split", "later before the split"])
def test_decisions_made_across_the_split_are_judged_in_the_order_they_were_made(
    tmp_path: Path, whole: list[int], monkeypatch: pytest.MonkeyPatch, moved: str
) -> None:
    # This process judges its decisions made before the later half's incidents opened while the other
    # decides; an earlier incident decided after that is merged with the later half's decisions, and a
    # later incident decided before it opened (a replica's clock behind) has everything judged again.
    store = Store(f"sqlite:///{tmp_path / 'medic.db'}")
    loaded = edited(tmp_path, "max_out_of_service_percent: 10", "max_out_of_service: 3")
    fill(store, loaded, 100)
    split = store.replay_split(None, parallel.EARLIER_SHARE)
    assert split is not None
    monkeypatch.setattr(parallel, "HANDFUL", 3)
    opened = col(IncidentRecord.opened_at)
    with store.engine.begin() as connection:
        if moved == "earlier after the split":
            incident = select(col(IncidentRecord.id)).where(opened < split.middle).order_by(opened.desc())
            row, at = func.max(col(DecisionRecord.id)), split.middle + HOUR
        else:
            incident = select(col(IncidentRecord.id)).where(opened >= split.middle).order_by(opened)
            row, at = func.min(col(DecisionRecord.id)), split.middle - HOUR
        chosen = select(row).where(col(DecisionRecord.incident_id) == incident.limit(1).scalar_subquery())
        connection.execute(
            update(DecisionRecord)
            .where(col(DecisionRecord.id) == chosen.scalar_subquery())
            .values(decided_at=at)
        )
    judged_again: list[int] = []
    monkeypatch.setattr(parallel, "judge", lambda *args: judged_again.append(1) or judge(*args))
    order: list[tuple[datetime, int]] = []

    class Recorded(Judge):
        def take(self, decisions: Iterable[Redecided]) -> None:
            taken = list(decisions)
            order.extend((d.decided_at, d.id) for d in taken)
            super().take(taken)

    monkeypatch.setattr(parallel, "Judge", Recorded)
    report = parallel.replay_store(store, loaded, None, parallel_from=0)
    assert whole == []
    assert judged_again == ([1] if moved == "later before the split" else [])
    if not judged_again:
        assert len(order) == report.decisions and order == sorted(order)
    assert report == in_one_process(store, loaded)
    store.close()


START = datetime(2026, 10, 1, tzinfo=UTC)
HOUR = timedelta(hours=1)
OUTCOME = Outcome(rule="r", action=Action.NONE)


def half(
    hours: tuple[int, int],
    read: tuple[int, int] | None,
    earliest: int,
    held_from: int | None = None,
    **flags: bool,
) -> Redecisions:
    """A part whose decisions are made from `hours[0]` to `hours[1]` (after START), holding the cluster's
    events from an hour before its first (or from `held_from`) to its last; `read`: the hours its
    windows read; `earliest`: its incidents' earliest event."""
    first, last = (START + h * HOUR for h in hours)
    decided = [
        Redecided(at, 1, "inc", "node", "node", OUTCOME, OUTCOME, None, True, None) for at in (first, last)
    ]
    held = (START + held_from * HOUR if held_from is not None else first - HOUR, last)
    reads = (START + read[0] * HOUR, START + read[1] * HOUR) if read else None
    return Redecisions(decided, 0, 0, held, reads, START + earliest * HOUR, **flags)


def test_halves_stand_for_one_replay_only_where_nothing_reads_across() -> None:
    # One replay of both would hold the cluster's events from an hour before the first decision (0).
    earlier = half((1, 10), (1, 9), 1)
    later = half((9, 20), (8, 20), 8, held_from=7)
    assert decided_as_one([earlier, later], HOUR)
    # Windows past the end of what a part holds, or before its start:
    assert not decided_as_one([half((1, 10), (1, 11), 1), later], HOUR)
    assert not decided_as_one([earlier, half((9, 20), (6, 20), 8, held_from=7)], HOUR)
    # Before the one replay's start only where the other part's incidents have no events:
    reaching = half((1, 10), (-1, 9), 1)
    assert decided_as_one([reaching, later], HOUR)
    assert not decided_as_one([reaching, half((9, 20), (8, 20), -1, held_from=7)], HOUR)
    # A part holding events from before the one replay's start holds more than it would:
    assert not decided_as_one([earlier, half((9, 20), (-1, 20), 8, held_from=-2)], HOUR)
    # A decision with no size for its switch takes the one recorded last before it, by any incident:
    sized = half((1, 10), None, 1, switch_sizes_recorded=True)
    assert not decided_as_one([sized, half((9, 20), None, 8, switch_sizes_missing=True)], HOUR)
    assert decided_as_one([sized, half((9, 20), None, 8)], HOUR)
    # Facts rebuilt or events gone: not one replay, whatever else.
    gone = Redecisions(earlier.decisions, 0, 1, earlier.held, earlier.read, earlier.earliest)
    assert not decided_as_one([gone, later], HOUR)


def test_the_store_splits_by_opening_and_each_half_holds_its_own(store: Store) -> None:
    loaded = load_policy(DEFAULT_POLICY)
    fill(store, loaded, 40)
    lookback = loaded.policy.lookback()
    split = store.replay_split(None)
    assert split is not None and split.incidents == 40
    one = store.replay_history(since=None, lookback=lookback)
    start = split.middle - lookback
    earlier = store.replay_history(since=None, until=split.middle, lookback=lookback)
    later = store.replay_history(since=split.middle, lookback=lookback, start=start)
    assert [d.id for d in earlier.decisions] + [d.id for d in later.decisions] == [
        d.id for d in one.decisions
    ]
    assert len({d.incident for d in earlier.decisions}) == 20
    assert later.start == start and later.end == one.end
    assert all(e.time >= start or e.id in _own_events(later) for e in later.events)
    # Read back as they were recorded: the events the fill validated, field for field.
    recorded = {e.id: e for e in one.events}
    for event in later.events:
        assert event == recorded[event.id] and event.model_dump() == recorded[event.id].model_dump()
    assert store.replay_split(split.middle + timedelta(days=365)) is None
    # Another share: that many of the incidents in the earlier part, one at least and all but one at most.
    for share, earlier_count in ((0.25, 10), (0.0, 1), (1.0, 39)):
        part = store.replay_split(None, share)
        assert part is not None
        until = store.replay_history(since=None, until=part.middle, lookback=lookback)
        assert len({d.incident for d in until.decisions}) == earlier_count


def _own_events(history: History) -> set[str]:
    return {e.id for events in history.incident_events.values() for e in events}


STUCK = """
import sys, time
import medic.apps.cli.replay_parallel as parallel
from medic.policy import load_policy
from medic.store import Store
parallel.HANDFUL = 5

def stuck(*_):
    print("ready", flush=True)
    time.sleep(300)

parallel.redecide = stuck
parallel.replay_store(Store(sys.argv[1]), load_policy(sys.argv[2]), None, parallel_from=0)
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_the_forked_part_ends_when_this_process_is_killed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'medic.db'}"
    store = Store(url)
    fill(store, load_policy(DEFAULT_POLICY), 2_000)  # the later part's decisions fill the pipe many times
    store.close()
    script = tmp_path / "stuck.py"
    script.write_text(STUCK, encoding="utf-8")
    assert_helper_ends_with_its_parent(script, url, str(DEFAULT_POLICY))
