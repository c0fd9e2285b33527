"""The rollout report's pairing (medic/rollout.py): GPU Medic's decisions beside people's node_state
changes, on hand-built records."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest

from medic.rollout import (
    AGREES,
    DecisionFact,
    Group,
    Opened,
    PeopleChange,
    Thresholds,
    build_rollout,
)

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
NOW = T0 + timedelta(days=30)
H = timedelta(hours=1)
DEFAULTS = Thresholds()


def decided(
    node: str,
    action: str = "reboot",
    *,
    at: datetime = T0,
    mode: str | None = "observe",
    group: str | None = "canary",
    incident: str | None = None,
) -> DecisionFact:
    return DecisionFact(
        incident=incident or f"inc-{node}-{at:%d%H%M}",
        node=node,
        at=at,
        action=action,
        mode=mode,
        group=group,
        rule="r",
    )


def did(node: str, change: str, at: datetime) -> PeopleChange:
    return PeopleChange(id=f"slurm-{node}-{change}-{int(at.timestamp())}", node=node, at=at, change=change)


def report(
    decisions: Sequence[DecisionFact],
    people: Sequence[PeopleChange] = (),
    opened: Sequence[Opened] = (),
    *,
    window: timedelta = timedelta(hours=6),
    recurrence: timedelta = timedelta(days=7),
    thresholds: Thresholds = DEFAULTS,
) -> dict[str, Group]:
    built = build_rollout(
        decisions,
        people,
        opened,
        modes_now={"canary": "observe"},
        since=None,
        now=NOW,
        window=window,
        recurrence=recurrence,
        thresholds=thresholds,
    )
    return {g.name: g for g in built.groups}


def only(groups: dict[str, Group]) -> Group:
    (group,) = groups.values()
    return group


@pytest.mark.parametrize(
    ("action", "change"),
    [(action, change) for action, changes in AGREES.items() for change in sorted(changes)],
)
def test_people_taking_the_same_kind_of_action_agree(action: str, change: str) -> None:
    g = only(report([decided("n1", action)], [did("n1", change, T0 + 2 * H)]))
    assert (g.would_have, g.agreed) == (1, 1)
    assert g.pairs[0].people_change == change
    assert g.saved_minutes_total == 120


def test_a_different_action_by_people_is_a_disagreement_and_destructive_for_a_reboot() -> None:
    g = only(report([decided("n1", "reboot")], [did("n1", "drain", T0 + H)]))
    assert (g.agreed, g.disagreed, g.destructive_disagreements) == (0, 1, 1)
    assert g.pairs[0].saved_minutes is None


def test_a_drain_people_did_not_follow_is_no_destructive_disagreement() -> None:
    g = only(report([decided("n1", "drain")], [did("n1", "reboot", T0 + H)]))
    assert (g.disagreed, g.destructive_disagreements) == (1, 0)


def test_an_agreeing_change_wins_over_a_different_one_before_it() -> None:
    g = only(report([decided("n1", "reboot")], [did("n1", "drain", T0 + H), did("n1", "reboot", T0 + 3 * H)]))
    assert g.agreed == 1
    assert g.pairs[0].saved_minutes == 180


def test_people_doing_nothing_then_the_node_failing_again_is_a_miss_by_people() -> None:
    later = Opened(incident="inc-later", node="n1", at=T0 + timedelta(days=6))
    g = only(report([decided("n1")], opened=[later]))
    assert (g.missed_by_people, g.false_alarm, g.destructive_disagreements) == (1, 0, 0)


def test_people_doing_nothing_and_no_failure_within_the_days_is_a_false_alarm() -> None:
    own = Opened(incident="inc-n1-011200", node="n1", at=T0 - timedelta(minutes=5))
    too_late = Opened(incident="inc-later", node="n1", at=T0 + timedelta(days=8))
    g = only(report([decided("n1")], opened=[own, too_late]))
    assert (g.missed_by_people, g.false_alarm, g.destructive_disagreements) == (0, 1, 1)


def test_the_recurrence_days_are_an_option() -> None:
    later = Opened(incident="inc-later", node="n1", at=T0 + timedelta(days=8))
    assert only(report([decided("n1")], opened=[later], recurrence=timedelta(days=9))).missed_by_people == 1


def test_a_decision_too_recent_to_know_whether_the_node_fails_again_is_pending() -> None:
    recent = decided("n1", at=NOW - timedelta(days=2))
    g = only(report([recent]))
    assert (g.pending, g.false_alarm) == (1, 0)
    assert g.readiness.agreement is None


def test_the_window_holds_its_ends_and_nothing_outside() -> None:
    window = timedelta(hours=6)
    inside = [decided("a"), decided("b")]
    people = [did("a", "reboot", T0), did("b", "reboot", T0 + window)]
    assert only(report(inside, people)).agreed == 2
    early = [did("c", "reboot", T0 - timedelta(seconds=1))]
    late = [did("d", "reboot", T0 + window + timedelta(seconds=1))]
    g = only(report([decided("c"), decided("d")], early + late))
    assert (g.agreed, g.false_alarm) == (0, 2)


def test_the_window_is_an_option() -> None:
    people = [did("n1", "reboot", T0 + 8 * H)]
    assert only(report([decided("n1")], people)).agreed == 0
    assert only(report([decided("n1")], people, window=timedelta(hours=9))).agreed == 1


def test_people_acting_with_no_decision_before_is_our_miss_once_per_response() -> None:
    people = [
        did("n1", "reboot_requested", T0),
        did("n1", "reboot", T0 + timedelta(minutes=4)),  # the same reboot, done
        did("n1", "drain", T0 + timedelta(days=2)),  # another response
        did("n2", "not_responding", T0),  # the scheduler noticing: no action
        did("n3", "resume", T0),  # a return to service: no action
    ]
    g = only(report([], people))
    assert g.name == "*"
    assert g.our_misses == 2
    assert g.missed == [people[0].id, people[2].id]


def test_a_change_after_any_decision_on_the_node_is_no_miss_even_an_escalation() -> None:
    escalated = decided("n1", "escalate", at=T0 - H)
    g = only(report([escalated], [did("n1", "drain", T0)]))
    assert (g.our_misses, g.would_have) == (0, 0)


def test_a_change_after_the_window_of_a_decision_is_our_miss_in_that_nodes_group() -> None:
    g = only(report([decided("n1", "drain", at=T0 - 7 * H)], [did("n1", "reboot", T0)]))
    assert (g.name, g.our_misses, g.false_alarm) == ("canary", 1, 1)


def test_contain_and_remediate_decisions_count_as_acted_per_mode_not_as_would_have() -> None:
    decisions = [
        decided("n1", at=T0),
        decided("n2", mode="contain", at=T0 + H),
        decided("n3", mode="remediate", at=T0 + 2 * H),
        decided("n4", mode=None, at=T0 + 3 * H),  # before modes: remediated
        decided("n5", "none", at=T0 + 4 * H),  # no node action: not counted
    ]
    g = only(report(decisions, [did("n2", "reboot", T0 + 2 * H)]))
    assert g.would_have == 1
    assert [(m.mode, m.decisions) for m in g.modes] == [("observe", 1), ("contain", 1), ("remediate", 2)]
    assert g.mode_now == "observe"


def test_an_incident_counts_once_by_its_first_decision() -> None:
    first = decided("n1", "diagnose", incident="inc-1")
    stopped = decided("n1", "escalate", at=T0 + H, incident="inc-1")
    g = only(report([stopped, first], [did("n1", "drain", T0 + 2 * H)]))
    assert (g.would_have, g.agreed) == (1, 1)


def test_groups_are_apart_and_a_filter_keeps_one() -> None:
    decisions = [decided("n1"), decided("n2", group=None), decided("n3", group="nvl72")]
    assert sorted(report(decisions)) == ["*", "canary", "nvl72"]
    built = build_rollout(decisions, [], [], modes_now={}, since=None, now=NOW, group="*")
    assert [(g.name, g.would_have) for g in built.groups] == [("*", 1)]
    nothing = build_rollout(decisions, [], [], modes_now={}, since=None, now=NOW, group="absent")
    assert [(g.name, g.would_have) for g in nothing.groups] == [("absent", 0)]


def test_since_keeps_earlier_records_as_context_only() -> None:
    before = decided("n1", "drain", at=T0 - H)
    built = build_rollout([before], [did("n1", "drain", T0)], [], modes_now={}, since=T0, now=NOW)
    assert built.groups == []


def test_minutes_saved_median_and_total() -> None:
    decisions = [decided("a"), decided("b"), decided("c")]
    people = [did("a", "reboot", T0 + H), did("b", "reboot", T0 + 2 * H), did("c", "reboot", T0 + 4 * H)]
    g = only(report(decisions, people))
    assert (g.saved_minutes_median, g.saved_minutes_total) == (120, 420)


def test_ready_when_every_threshold_holds() -> None:
    decisions = [decided(f"n{i}", at=T0 + i * timedelta(minutes=1)) for i in range(20)]
    people = [did(f"n{i}", "reboot", T0 + H) for i in range(19)]  # n19: nothing, then failing again
    opened = [Opened(incident="inc-next", node="n19", at=T0 + timedelta(days=1))]
    g = only(report(decisions, people, opened, thresholds=Thresholds(decisions=20)))
    assert g.readiness.model_dump() == {"ready": True, "agreement": 1.0, "reasons": []}


def test_not_ready_says_each_threshold_missed() -> None:
    decisions = [decided("a"), decided("b")]
    g = only(report(decisions, [did("a", "reboot", T0 + H)]))  # b: a false alarm
    assert not g.readiness.ready
    assert g.readiness.agreement == 0.5
    assert g.readiness.reasons == [
        "2 would-have decisions, fewer than 50",
        "agreement 50.0%, below 95%",
        "1 destructive disagreements, more than 0",
    ]


def test_people_resuming_the_node_disagrees_with_a_drain_and_the_scheduler_noticing_is_nothing() -> None:
    g = only(
        report(
            [decided("a", "drain"), decided("b", "replace")],
            [did("a", "resume", T0 + H), did("b", "not_responding", T0 + H)],
        )
    )
    assert [p.verdict for p in g.pairs] == ["disagreed", "false_alarm"]
