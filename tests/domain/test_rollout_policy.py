"""What the policy says of the rollout report (medic/rollout.py): each group's readiness thresholds, and
the group a miss on a node with no decision is reported in, placed by name or kept under `*` with why."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from checkout import REPO_ROOT

from medic.policy import PolicyError
from medic.policy.loader import parse_policy
from medic.policy.selectors import OTHER_NODES
from medic.rollout import Override, PeopleChange, Thresholds, build_rollout, placer, policy_thresholds

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)

POLICY = """\
readiness: {min_decisions: 20, min_agreement: 0.9}
groups:
  - name: canary
    select: {hostlist: ["gpu-[1-4]"]}
    mode: observe
    readiness: {max_destructive_disagreements: 2}
  - name: racks
    select: {names: ["rack-*"], partitions: [gb200]}
    mode: observe
  - name: big
    select: {features: [nvl72]}
    mode: contain
    readiness: {min_decisions: 5}
rules: []
"""
CANARY_ONLY = (
    "groups:\n  - name: canary\n    select: {hostlist: ['gpu-[1-4]']}\n    mode: observe\nrules: []\n"
)


def test_a_policy_without_readiness_keeps_the_report_defaults() -> None:
    assert policy_thresholds(parse_policy("rules: []", "p.yaml")) == {OTHER_NODES: Thresholds()}


def test_a_group_changes_only_the_keys_it_gives_and_the_rest_are_the_policys() -> None:
    thresholds = policy_thresholds(parse_policy(POLICY, "p.yaml"))
    assert thresholds == {
        OTHER_NODES: Thresholds(20, 0.9, 0),
        "canary": Thresholds(20, 0.9, 2),
        "racks": Thresholds(20, 0.9, 0),
        "big": Thresholds(5, 0.9, 0),
    }


def test_an_option_given_wins_over_the_policy_for_every_group() -> None:
    thresholds = policy_thresholds(parse_policy(POLICY, "p.yaml"), Override(agreement=0.5))
    assert {t.agreement for t in thresholds.values()} == {0.5}
    assert (thresholds["big"].decisions, thresholds["canary"].destructive_disagreements) == (5, 2)


@pytest.mark.parametrize(
    ("text", "line", "where"),
    [
        ("readiness: {min_agreement: 1.5}\nrules: []\n", 1, "readiness.min_agreement"),
        ("rules: []\nreadiness:\n  min_decisions: -1\n", 3, "readiness.min_decisions"),
        ("readiness: {min_agreemnt: 0.5}\nrules: []\n", 1, "readiness.min_agreemnt: unknown key"),
        (
            "groups:\n  - name: g\n    select: {names: [a*]}\n    mode: observe\n"
            "    readiness: {max_destructive_disagreements: -2}\nrules: []\n",
            5,
            "groups.0.readiness.max_destructive_disagreements",
        ),
    ],
)
def test_a_bad_threshold_is_refused_at_its_line(text: str, line: int, where: str) -> None:
    with pytest.raises(PolicyError) as refused:
        parse_policy(text, "p.yaml")
    (problem,) = refused.value.problems
    assert (problem.file, problem.line) == ("p.yaml", line)
    assert problem.message.startswith(where)


def test_a_group_judged_against_its_own_thresholds() -> None:
    thresholds = {OTHER_NODES: Thresholds(decisions=50), "canary": Thresholds(decisions=0, agreement=0)}
    built = build_rollout(
        [],
        [PeopleChange("d1", "gpu-1", T0, "drain")],
        [],
        modes_now={},
        since=None,
        now=T0 + timedelta(days=30),
        thresholds=thresholds[OTHER_NODES],
        group_thresholds=thresholds,
        placed=placer(parse_policy(CANARY_ONLY, "p.yaml")),
    )
    (canary,) = built.groups
    assert built.thresholds == {"decisions": 50, "agreement": 0.95, "destructive_disagreements": 0}
    assert canary.thresholds == {"decisions": 0, "agreement": 0, "destructive_disagreements": 0}
    assert canary.readiness.reasons == ["agreement none judged, below 0%"]


def test_a_miss_goes_to_the_group_its_name_puts_it_in_and_a_fact_not_known_keeps_it_under_star() -> None:
    policy = parse_policy(POLICY.replace("features: [nvl72]", "names: [big-*], features: [nvl72]"), "p.yaml")
    people = [
        PeopleChange("by-name", "gpu-2", T0, "drain"),  # canary, by hostlist: the name is enough
        PeopleChange("needs-partition", "rack-a1", T0, "drain"),  # racks needs its partition too
        PeopleChange("needs-features", "big-7", T0, "reboot"),  # big needs its features
    ]
    built = build_rollout(
        [],
        people,
        [],
        modes_now={},
        since=None,
        now=T0 + timedelta(days=30),
        placed=placer(policy),
    )
    groups = {g.name: g for g in built.groups}
    assert sorted(groups) == [OTHER_NODES, "canary"]
    assert (groups["canary"].missed, groups["canary"].unplaced) == (["by-name"], [])
    other = groups[OTHER_NODES]
    assert other.missed == ["needs-partition", "needs-features"]
    assert [(u.event, u.node) for u in other.unplaced] == [
        ("needs-partition", "rack-a1"),
        ("needs-features", "big-7"),
    ]
    assert "cannot tell whether rack-a1 is in group racks: the scheduler gives no partitions" in (
        other.unplaced[0].why
    )
    assert "group big" in other.unplaced[1].why
    assert other.unplaced[1].why.endswith("(the report knows a node by its name only)")


def test_a_group_on_facts_alone_keeps_every_nodes_miss_under_star() -> None:
    """Any node may have the features: even a node another group names cannot be told apart."""
    built = build_rollout(
        [],
        [PeopleChange("d", "gpu-2", T0, "drain")],
        [],
        modes_now={},
        since=None,
        now=T0 + timedelta(days=30),
        placed=placer(parse_policy(POLICY, "p.yaml")),
    )
    ((other),) = built.groups
    assert (other.name, other.missed) == (OTHER_NODES, ["d"])
    assert other.unplaced[0].why.startswith("cannot tell whether gpu-2 is in group big")


def test_a_node_no_group_can_take_by_its_name_is_in_no_group_without_a_reason() -> None:
    policy = parse_policy(CANARY_ONLY, "p.yaml")
    built = build_rollout(
        [],
        [PeopleChange("d", "gpu-9", T0, "drain")],
        [],
        modes_now={},
        since=None,
        now=T0 + timedelta(days=30),
        placed=placer(policy),
    )
    ((other),) = built.groups
    assert (other.name, other.missed, other.unplaced) == (OTHER_NODES, ["d"], [])


def test_the_schema_pins_the_readiness_keys() -> None:
    """The contract decision 0020 adds: `readiness` at the top level (each key with the report's old
    default) and in a group (each key optional)."""
    schema = json.loads((REPO_ROOT / "policies" / "policy.schema.json").read_text(encoding="utf-8"))
    defs = schema["$defs"]
    top = defs["ReadinessThresholds"]["properties"]
    assert {k: v["default"] for k, v in top.items()} == {
        "min_decisions": 50,
        "min_agreement": 0.95,
        "max_destructive_disagreements": 0,
    }
    assert set(defs["GroupReadinessThresholds"]["properties"]) == set(top)
    assert "required" not in defs["GroupReadinessThresholds"]
    assert "readiness" not in schema.get("required", [])
