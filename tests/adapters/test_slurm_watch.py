"""What people did to nodes, from Slurm's record (docs/decisions/0019-human-actions-as-events.md): listings
compared poll to poll, on the recorded 22.05 documents and the documents built from each later generation
(tests/fixtures/slurm/SOURCES.md); GPU Medic's own changes left out; one id per change in every replica.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from checkout import TEST_FIXTURES
from sqlmodel import select

from medic.apps.server.people import GRACE, PeopleWatch, interval_s, ours_in
from medic.events import FaultEvent
from medic.integrations.slurm.cli import SlurmCli
from medic.integrations.slurm.errors import SlurmUnreachableError
from medic.integrations.slurm.records import GENERATIONS, generation
from medic.integrations.slurm.watch import NodeWatch
from medic.statuses import ActionStatus
from medic.store import Store
from medic.store.tables import ActionRecord

FIXTURES = TEST_FIXTURES / "slurm"
NEWER = [g for g in GENERATIONS if g >= 39]
SEEN = datetime(2026, 11, 23, 14, 30, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def recorded(letter: str) -> dict[str, Any]:
    """22.05 (recorded): a → b → c → d is one afternoon on our cluster (SOURCES.md)."""
    return load(f"v0.0.38-sinfo-{letter}.json")


def never(*_: object) -> bool:
    return False


def summary(events: list[FaultEvent]) -> list[tuple[str, str, str | None, str | None]]:
    return [(e.node, e.attributes["change"], e.attributes.get("reason"), e.attributes.get("reason_set_by"))
            for e in events]  # fmt: skip


def all_idle(doc: dict[str, Any]) -> dict[str, Any]:
    """The same listing with every node idle, no reason: the baseline before the fixture's changes."""
    idle = copy.deepcopy(doc)
    for raw in idle["nodes"]:
        raw["state"], raw["reason"], raw["reason_set_by_user"] = ["IDLE"], "", ""
        raw["reason_changed_at"] = {"set": True, "infinite": False, "number": 0}
    return idle


def test_the_first_poll_is_a_baseline_and_says_nothing() -> None:
    """A restart must not report every drained node of the cluster as just drained."""
    watch = NodeWatch(SlurmCli(), never)
    assert watch.take(recorded("b"), SEEN) == []
    assert watch.take(recorded("b"), SEEN + MINUTE) == []  # nothing changed


def test_recorded_2205_listings_in_turn_give_each_change_of_others_once() -> None:
    watch = NodeWatch(SlurmCli(), never)
    watch.take(recorded("a"), SEEN)
    # b: an admin drains gpu-node-4, already down; GPU Medic drains gpu-node-2 (`medic:`: ours).
    (drain,) = watch.take(recorded("b"), SEEN + MINUTE)
    assert summary([drain]) == [("gpu-node-4", "drain", "admin: psu swap", "root")]
    assert drain.id == "slurm-gpu-node-4-drain-1795442974"
    assert drain.source == "slurm" and drain.kind == "node_state"
    assert drain.time == datetime.fromtimestamp(1795442974, UTC)  # when Slurm says, not when seen
    assert drain.attributes["state"] == "DOWN+DRAIN" and drain.attributes["previous"] == "DOWN"
    assert drain.attributes["reason_set_at"] == "2026-11-23T14:09:34Z"
    assert drain.attributes["seen_at"] == "2026-11-23T14:31:00Z"
    # c: gpu-node-2 is resumed, by no action of ours; GPU Medic asks to reboot gpu-node-3 (ours).
    (resume,) = watch.take(recorded("c"), SEEN + 2 * MINUTE)
    assert summary([resume]) == [("gpu-node-2", "resume", "medic: xid 79 on GPU 3 incident T1", "root")]
    assert resume.time == SEEN + 2 * MINUTE  # Slurm keeps no time for a resume
    assert resume.id == "slurm-gpu-node-2-resume-1795442976"  # keyed on the hold it ended
    # d: gpu-node-2's slurmd stops answering; gpu-node-3 comes back with a later BootTime.
    events = watch.take(recorded("d"), SEEN + 3 * MINUTE)
    assert summary(events) == [
        ("gpu-node-2", "not_responding", None, None),
        ("gpu-node-3", "reboot", None, None),
    ]
    not_responding, reboot = events
    assert not_responding.id == "slurm-gpu-node-2-not_responding-1795441338"  # keyed on its boot
    assert reboot.time == datetime.fromtimestamp(1795442991, UTC)  # the new BootTime


@pytest.mark.parametrize("gen", NEWER)
def test_each_generation_reports_others_changes_and_never_a_medic_reason(gen: int) -> None:
    """The built documents' eleven nodes, from all idle: admin drains, down and not responding nodes
    are people's or Slurm's; the `medic:` drain, reboot request and issued reboot are ours."""
    doc = load(f"v0.0.{gen}-scontrol-show-nodes.json")
    watch = NodeWatch(SlurmCli(), never)
    watch.take(all_idle(doc), SEEN)
    by = "root" if gen >= 41 else None  # the 23.02 and 23.11 documents were trimmed of who and when
    assert summary(watch.take(doc, SEEN + MINUTE)) == [
        ("gpu-node-4", "drain", "admin: bad fan", by),
        ("gpu-node-5", "drain", "admin: bad fan", by),
        ("gpu-node-6", "drain", "admin: psu swap", by),
        ("gpu-node-6", "down", "admin: psu swap", by),
        ("gpu-node-7", "down", "Not responding", by),
        ("gpu-node-7", "not_responding", "Not responding", by),
        ("gpu-node-8", "not_responding", None, None),
    ]
    # And back: each held node resumed, ours included (people may resume what GPU Medic drained).
    resumed = watch.take(all_idle(doc), SEEN + 2 * MINUTE)
    assert [(e.node, e.attributes["change"]) for e in resumed] == [
        (f"gpu-node-{i}", "resume") for i in (4, 5, 6, 7, 9, 11)
    ]


def test_a_node_that_vanishes_is_no_action_and_one_that_returns_is_a_new_baseline() -> None:
    watch = NodeWatch(SlurmCli(), never)
    watch.take(recorded("a"), SEEN)
    gone = recorded("b")
    gone["nodes"] = [n for n in gone["nodes"] if n["name"] != "gpu-node-4"]
    assert watch.take(gone, SEEN + MINUTE) == []
    assert watch.take(recorded("b"), SEEN + 2 * MINUTE) == []


def test_an_unreadable_record_keeps_its_last_view_and_blinds_no_other_node(caplog: Any) -> None:
    watch = NodeWatch(SlurmCli(), never)
    watch.take(recorded("a"), SEEN)
    odd = recorded("b")
    odd["nodes"][0]["state"] = "sideways"  # gpu-node-1
    with caplog.at_level(logging.WARNING, "medic.slurm.watch"):
        assert summary(watch.take(odd, SEEN + MINUTE)) == [("gpu-node-4", "drain", "admin: psu swap", "root")]
    assert "gpu-node-1" in caplog.text and "SIDEWAYS" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "medic.slurm.watch"):
        assert watch.take(odd, SEEN + MINUTE * 1.5) == []
    assert caplog.text == ""  # said once, not at every poll
    odd["nodes"][0] = copy.deepcopy(recorded("a")["nodes"][0]) | {"state_flags": []}  # readable: resumed
    assert summary(watch.take(odd, SEEN + 2 * MINUTE)) == [("gpu-node-1", "resume", "admin: bad fan", "root")]


def test_a_listing_without_boot_times_reports_no_reboot() -> None:
    """The built documents carry no `boot_time` (trimmed): unknown, so no reboot is made up."""
    doc = load("v0.0.42-scontrol-show-nodes.json")
    watch = NodeWatch(SlurmCli(), never)
    watch.take(doc, SEEN)
    assert watch.take(doc, SEEN + MINUTE) == []


# --- our own node actions, from the store's actions table ----------------------------------------


def act(store: Store, node: str, action: str, at: datetime, finished: datetime | None) -> None:
    store.claim_action(f"inc-1:{node}:{action}", "inc-1", node, action)
    with store.session() as s:
        row = s.exec(select(ActionRecord).where(ActionRecord.node == node)).one()
        row.intent_at, row.finished_at = at, finished
        row.status = ActionStatus.SUCCEEDED if finished else ActionStatus.INTENT
        s.add(row)
        s.commit()


def test_a_change_one_of_our_actions_made_is_not_reported(sqlite_store: Store) -> None:
    """Our resume of gpu-node-2 and our reboot of gpu-node-3 (still waiting for the node) are ours."""
    act(sqlite_store, "gpu-node-2", "resume", SEEN + MINUTE + timedelta(seconds=10), SEEN + MINUTE * 1.5)
    act(sqlite_store, "gpu-node-3", "reboot", SEEN + MINUTE * 1.5, None)
    watch = NodeWatch(SlurmCli(), ours_in(sqlite_store))
    for step, letter in enumerate("abc"):
        watch.take(recorded(letter), SEEN + step * MINUTE)
    assert summary(watch.take(recorded("d"), SEEN + 3 * MINUTE)) == [
        ("gpu-node-2", "not_responding", None, None)
    ]


def test_an_action_of_ours_long_over_is_no_cover_for_a_persons(sqlite_store: Store) -> None:
    over = SEEN + MINUTE - GRACE - MINUTE
    act(sqlite_store, "gpu-node-2", "resume", over - MINUTE, over)
    watch = NodeWatch(SlurmCli(), ours_in(sqlite_store))
    watch.take(recorded("b"), SEEN + MINUTE)
    assert summary(watch.take(recorded("c"), SEEN + 2 * MINUTE))[0][:2] == ("gpu-node-2", "resume")


def test_a_drain_is_never_covered_by_an_action_only_its_medic_reason_makes_it_ours(
    sqlite_store: Store,
) -> None:
    act(sqlite_store, "gpu-node-4", "drain", SEEN, None)
    watch = NodeWatch(SlurmCli(), ours_in(sqlite_store))
    watch.take(recorded("a"), SEEN)
    assert summary(watch.take(recorded("b"), SEEN + MINUTE)) == [
        ("gpu-node-4", "drain", "admin: psu swap", "root")
    ]


# --- serve's poller: one command a poll, stored once, failures retried ------------------------------


class ListingCli(SlurmCli):
    """Answers with the listings given, one per node read; records each command."""

    def __init__(self, *listings: dict[str, Any]) -> None:
        super().__init__()
        self.listings = list(listings)
        self.commands: list[tuple[str, ...]] = []

    def run(self, *args: str) -> str:
        self.commands.append(args)
        if not self.listings:
            raise SlurmUnreachableError(list(args), "no answer within 30 s")
        doc = self.listings[0]
        if args[0] == "sinfo" and generation(doc) != 38:
            return json.dumps({"sinfo": [], "meta": doc["meta"], "errors": []})  # 23.02+: grouped rows
        return json.dumps(self.listings.pop(0))


def test_each_poll_is_one_command_once_the_release_is_known(sqlite_store: Store) -> None:
    doc = load("v0.0.42-scontrol-show-nodes.json")
    cli = ListingCli(all_idle(doc), doc, doc)
    watch = PeopleWatch(sqlite_store, NodeWatch(cli, ours_in(sqlite_store)))
    assert [watch.poll() for _ in range(3)] == [0, 7, 0]
    assert cli.commands == [("sinfo", "--json"), *[("scontrol", "--json", "show", "nodes")] * 3]


def test_two_replicas_store_each_change_once(sqlite_store: Store) -> None:
    """Replicas poll at their own moments; the ids come from Slurm's times, so the store keeps one."""
    first = PeopleWatch(
        sqlite_store,
        NodeWatch(ListingCli(recorded("a"), recorded("b"), recorded("c")), ours_in(sqlite_store)),
    )
    second = PeopleWatch(
        sqlite_store,
        NodeWatch(ListingCli(recorded("a"), recorded("b"), recorded("c")), ours_in(sqlite_store)),
    )
    first.watch.clock = lambda: SEEN
    assert (first.poll(), second.poll()) == (0, 0)
    assert (first.poll(), second.poll()) == (1, 0)
    first.watch.clock = lambda: SEEN + 2 * MINUTE  # the resume: seen a minute apart, stored once
    assert (second.poll(), first.poll()) == (1, 0)
    stored = sqlite_store.events_between(SEEN - timedelta(days=30), SEEN + timedelta(days=30))
    assert sorted(e.id for e in stored) == [
        "slurm-gpu-node-2-resume-1795442976",
        "slurm-gpu-node-4-drain-1795442974",
    ]
    assert sqlite_store.undispatched_events() == []  # stored, never handed to remediation
    assert sqlite_store.find_incidents() == []


def test_a_failed_poll_is_logged_and_the_next_one_compares_with_the_last_listing(
    sqlite_store: Store, caplog: Any
) -> None:
    """slurmctld down for a poll: serve goes on, and the change made meanwhile is still reported."""
    cli = ListingCli(recorded("a"))
    watch = PeopleWatch(sqlite_store, NodeWatch(cli, ours_in(sqlite_store)))

    async def run() -> None:
        task = asyncio.create_task(watch.forever(0.01))
        await asyncio.sleep(0.2)  # the baseline, then failures
        cli.listings.append(recorded("b"))
        await asyncio.sleep(0.2)
        task.cancel()

    with caplog.at_level(logging.ERROR, "medic.people"):
        asyncio.run(run())
    assert "reading what people did to nodes from Slurm failed" in caplog.text
    assert "no answer within 30 s" in caplog.text
    assert [
        e.id for e in sqlite_store.events_between(SEEN - timedelta(days=30), SEEN + timedelta(days=30))
    ] == ["slurm-gpu-node-4-drain-1795442974"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", 30.0), ("5", 5.0), ("0", 0.0), ("3600", 3600.0), ("4", None), ("soon", None), ("-1", None)],
)
def test_the_interval_setting(value: str, expected: float | None) -> None:
    env = {"MEDIC_SLURM_WATCH_SECONDS": value} if value else {}
    if expected is None:
        with pytest.raises(ValueError, match="MEDIC_SLURM_WATCH_SECONDS"):
            interval_s(env)
    else:
        assert interval_s(env) == expected
