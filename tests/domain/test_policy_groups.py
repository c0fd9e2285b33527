"""Node groups in the policy (decision 0017): the selectors, the checks `medic policy check` makes at
file:line, where a node lands and why, and what its mode does to a decision."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkout import REPO_ROOT

from medic.hostlist import HostlistTooLarge, expand_hostlist
from medic.policy import Action, Classification, Decision, Mode, PolicyError, load_policy
from medic.policy.groups import approvals_for, in_mode, members, place, place_all, policy_for
from medic.policy.loader import parse_policy
from medic.protocols import NodeInfo, NodeState

RULES = """\
rules:
  - id: bus-off
    description: XID 79
    when: {xid: [79]}
    then: {classification: hardware, action: reboot}
"""


def policy_with(groups: str, top: str = "") -> str:
    return top + RULES + "groups:\n" + groups


def node(name: str, **facts: object) -> NodeInfo:
    return NodeInfo(name=name, state=NodeState.IDLE, **facts)  # type: ignore[arg-type]


def problem_of(text: str, tmp_path: Path) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    (problem,) = caught.value.problems
    return str(problem).removeprefix(f"{path}:")


def line_of(text: str, needle: str) -> int:
    return max(n for n, line in enumerate(text.splitlines(), start=1) if needle in line)


# --- the checks, at file:line ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "at", "message"),
    [
        (
            "  - {name: a, select: {partitions: [gpu]}, mode: observe}\n"
            "  - {name: b, select: {partitions: [gpu]}, mode: remediate}\n",
            "name: b",
            "groups.1.select: group 'b' overlaps group 'a' (partition gpu)",
        ),
        (
            "  - {name: a, select: {partitions: [gpu]}, mode: observe}\n"
            "  - {name: b, select: {partitions: [gpu], features: [nvl72]}, mode: contain}\n",
            "name: b",
            "groups.1.select: group 'b' overlaps group 'a' (partition gpu)",
        ),
        (
            "  - {name: a, select: {hostlist: ['gpu-node-[1-4]']}, mode: observe}\n"
            "  - {name: b, select: {hostlist: ['gpu-node-[4-8]']}, mode: remediate}\n",
            "name: b",
            "groups.1.select: group 'b' overlaps group 'a' (both name gpu-node-4)",
        ),
        (
            "  - {name: a, select: {hostlist: ['gpu-node-[1-4]']}, mode: observe}\n"
            "  - {name: b, select: {names: ['gpu-node-3*']}, mode: remediate}\n",
            "name: b",
            "groups.1.select: group 'b' overlaps group 'a' (gpu-node-3 is named by one and fits gpu-node-3*)",
        ),
        (
            "  - {name: a, select: {hostlist: ['gpu-node-[1-4]']}, mode: observe}\n"
            "  - {name: a, select: {hostlist: ['gpu-node-9']}, mode: remediate}\n",
            "gpu-node-9",
            "groups.1.name: group name 'a' is used twice",
        ),
        (
            "  - {name: a, select: {}, mode: observe}\n",
            "name: a",
            "groups.0.select: an empty selector",
        ),
        (
            "  - {name: a, select: {partitions: []}, mode: observe}\n",
            "name: a",
            "groups.0.select.partitions: List should have at least 1 item",
        ),
        (
            "  - {name: a, select: {hostlist: ['gpu-[1-999999999]']}, mode: observe}\n",
            "name: a",
            "groups.0.select.hostlist: hostlist 'gpu-[1-999999999]' names 999999999 nodes; at most 100000",
        ),
        (
            "  - {name: a, select: {hostlist: ['gpu-node-1']}, mode: watch}\n",
            "name: a",
            "groups.0.mode: expected 'observe', 'contain' or 'remediate', got 'watch'",
        ),
        (
            "  - name: a\n    select: {hostlist: ['gpu-node-1']}\n    mode: observe\n"
            "    rules:\n      - {id: bus-off, description: again, when: {xid: [79]},"
            " then: {classification: hardware, action: drain}}\n",
            "id: bus-off, description: again",
            "groups.0.rules.0.id: rule id 'bus-off' is used twice",
        ),
    ],
    ids=[
        "same-partition",
        "same-partition-one-narrower",
        "hostlists-intersect",
        "hostlist-node-fits-a-pattern",
        "duplicate-name",
        "empty-selector",
        "empty-list",
        "hostlist-too-large",
        "unknown-mode",
        "rule-id-used-twice",
    ],
)
def test_policy_check_refuses_groups_it_can_tell_are_wrong_at_their_line(
    tmp_path: Path, groups: str, at: str, message: str
) -> None:
    text = policy_with(groups)
    problem = problem_of(text, tmp_path)
    assert problem.startswith(f"{line_of(text, at)}:"), problem
    assert message in problem, problem


@pytest.mark.parametrize(
    "groups",
    [
        # A node in both partitions is possible, not certain: caught when met (a node in two groups).
        "  - {name: a, select: {partitions: [gpu]}, mode: observe}\n"
        "  - {name: b, select: {partitions: [big]}, mode: remediate}\n",
        # Told apart on different facts: the file cannot say whether gpu-node-1 is an NVL72 rack's.
        "  - {name: a, select: {hostlist: ['gpu-node-[1-4]']}, mode: observe}\n"
        "  - {name: b, select: {features: [nvl72]}, mode: remediate}\n",
        "  - {name: a, select: {partitions: [gpu], gpu_model: [h100]}, mode: observe}\n"
        "  - {name: b, select: {partitions: [gpu], gpu_model: [b200]}, mode: remediate}\n",
        "  - {name: a, select: {features: [nvl72, rack-a]}, mode: observe}\n"
        "  - {name: b, select: {features: [nvl72, rack-b]}, mode: remediate}\n",
    ],
    ids=["two-partitions", "names-and-features", "gpu-models-apart", "features-apart"],
)
def test_groups_the_file_cannot_show_to_overlap_are_accepted(groups: str) -> None:
    assert len(parse_policy(policy_with(groups), "p.yaml").groups) == 2


def test_a_policy_without_groups_remediates_every_node_as_before() -> None:
    policy = parse_policy(RULES, "p.yaml")
    assert (policy.mode, policy.groups) == (Mode.REMEDIATE, [])
    placement = place(policy, node("gpu-node-1"))
    assert (placement.mode, placement.group, placement.problem) == (Mode.REMEDIATE, None, None)


def test_the_shipped_policy_is_unchanged_by_groups() -> None:
    policy = load_policy(REPO_ROOT / "policies" / "default.yaml").policy
    assert policy.mode is Mode.REMEDIATE and policy.groups == []


# --- where a node lands, and why ------------------------------------------------------------------

PLACED = parse_policy(
    policy_with(
        "  - {name: canary, select: {hostlist: ['gpu-node-[1-2]'], names: ['canary-*']}, mode: observe}\n"
        "  - {name: nvl72, select: {partitions: [gpu], features: [nvl72], gpu_model: [GB200], gpus: [4]},"
        " mode: contain}\n",
        top="mode: contain\n",
    ),
    "p.yaml",
)


@pytest.mark.parametrize(
    ("info", "group", "mode", "why"),
    [
        (node("gpu-node-2", features=()), "canary", Mode.OBSERVE, "gpu-node-2 is in hostlist gpu-node-[1-2]"),
        (node("canary-7", features=()), "canary", Mode.OBSERVE, "canary-7 fits canary-*"),
        (
            node("rack-1", partitions=("gpu", "all"), features=("nvl72", "ib"), gpu_model="gb200", gpus=4),
            "nvl72",
            Mode.CONTAIN,
            "rack-1 is in group nvl72 (partition gpu; features nvl72; GPU model gb200; 4 GPUs)",
        ),
        (
            node("gpu-node-9", partitions=("gpu",), features=(), gpu_model="h100", gpus=8),
            None,
            Mode.CONTAIN,
            "gpu-node-9 is in no group (not canary: gpu-node-9 is not among gpu-node-[1-2], canary-*; "
            "not nvl72: features none lack nvl72): the policy's mode applies",
        ),
    ],
    ids=["by-hostlist", "by-pattern", "by-every-fact", "in-none"],
)
def test_a_node_lands_in_its_group_and_says_why(
    info: NodeInfo, group: str | None, mode: Mode, why: str
) -> None:
    placement = place(PLACED, info)
    assert (placement.group_name, placement.mode, placement.problem) == (group, mode, None)
    assert why in placement.why


def test_a_missing_fact_is_never_guessed() -> None:
    placement = place(PLACED, node("rack-2", features=("nvl72",), gpu_model="gb200", gpus=4))
    assert (placement.group, placement.mode) == (None, Mode.OBSERVE)
    assert (
        placement.problem
        == "cannot tell whether rack-2 is in group nvl72: the scheduler gives no partitions for it"
    )
    # A fact that already rules the group out is enough: nothing is missing for that.
    assert place(PLACED, node("rack-3", features=(), gpus=4)).problem is None


def test_a_node_two_groups_take_has_no_group() -> None:
    policy = parse_policy(
        policy_with(
            "  - {name: a, select: {partitions: [gpu]}, mode: remediate}\n"
            "  - {name: b, select: {partitions: [big]}, mode: remediate}\n"
        ),
        "p.yaml",
    )
    placement = place(policy, node("n1", partitions=("gpu", "big")))
    assert (placement.group, placement.mode, placement.problem) == (
        None,
        Mode.OBSERVE,
        "n1 fits groups a and b",
    )


def test_a_switch_wide_incident_takes_the_least_mode_of_its_nodes() -> None:
    placement = place_all(PLACED, ["gpu-node-1", "gpu-node-9"], [node("gpu-node-9", features=())])
    assert (placement.mode, placement.group) == (Mode.OBSERVE, None)


def test_a_groups_limits_count_the_nodes_it_may_take() -> None:
    nvl72 = PLACED.groups[1]
    fleet = [
        node("r1", partitions=("gpu",), features=("nvl72",), gpu_model="gb200", gpus=4),
        node("r2", partitions=None, features=("nvl72",), gpu_model="gb200", gpus=4),  # may be
        node("h1", partitions=("gpu",), features=(), gpu_model="h100", gpus=8),
    ]
    assert members(nvl72, fleet) == {"r1", "r2"}


# --- what a mode does to a decision ------------------------------------------------------------


def decision(action: Action = Action.REBOOT) -> Decision:
    return Decision(
        incident="inc-1",
        classification=Classification.HARDWARE,
        action=action,
        rule="bus-off",
        reason="XID 79",
    )


def test_contain_makes_a_repair_wait_for_approval_and_records_its_mode() -> None:
    contained = in_mode(decision(), place(PLACED, node("x", partitions=("cpu",))))
    assert (contained.action, contained.approve, contained.mode, contained.group) == (
        Action.REBOOT,
        True,
        Mode.CONTAIN,
        None,
    )
    assert "contain mode: the reboot waits for a human's approval" in contained.reason
    drain = in_mode(decision(Action.DRAIN), place(PLACED, node("x", partitions=("cpu",))))
    assert not drain.approve  # taking the node out is what contain is for


def test_observe_keeps_what_would_have_been_done() -> None:
    observed = in_mode(decision(), place(PLACED, node("gpu-node-1", features=())))
    assert (observed.action, observed.mode, observed.group, observed.approve) == (
        Action.REBOOT,
        Mode.OBSERVE,
        "canary",
        False,
    )


def test_an_undecidable_group_escalates_and_says_why() -> None:
    escalated = in_mode(decision(), place(PLACED, node("rack-2", features=("nvl72",))))
    assert (escalated.action, escalated.blocked_action, escalated.mode) == (
        Action.ESCALATE,
        Action.REBOOT,
        Mode.OBSERVE,
    )
    assert "node group undecidable: cannot tell whether rack-2 is in group nvl72" in escalated.reason


def test_a_groups_rules_and_approvals_apply_to_its_nodes_only() -> None:
    policy = parse_policy(
        policy_with(
            "  - name: racks\n    select: {features: [nvl72]}\n    mode: remediate\n"
            "    approvals: {required_for: [reboot], timeout_minutes: 5}\n"
            "    rules:\n      - {id: rack-first, description: drain the tray first, override: true,"
            " when: {xid: [79]}, then: {classification: hardware, action: drain}}\n",
            top="approvals: {approvers: [U0ALICE], required_for: [replace]}\n",
        ),
        "p.yaml",
    )
    racks = policy.groups[0]
    effective = policy_for(policy, racks)
    assert [r.id for r in effective.rules] == ["bus-off", "rack-first"]
    assert policy_for(policy, racks) is effective  # compiled once
    assert approvals_for(policy, racks).model_dump() == {
        "approvers": ["U0ALICE"],
        "required_for": [Action.REBOOT],
        "timeout_minutes": 5,
        "on_timeout": "escalate",
    }
    assert policy_for(policy, None) is policy


def test_hostlists_expand_within_a_bound() -> None:
    assert expand_hostlist("n[1-2]-[01-02]", limit=4) == ("n1-01", "n1-02", "n2-01", "n2-02")
    with pytest.raises(HostlistTooLarge):
        expand_hostlist("n[1-2]-[01-03]", limit=5)


def test_a_groups_windowed_rules_widen_the_context_every_decision_reads() -> None:
    policy = parse_policy(
        policy_with(
            "  - name: racks\n    select: {features: [nvl72]}\n    mode: remediate\n"
            "    rules:\n      - {id: rack-flaps, description: XIDs all day, when: {count: [{kinds: [xid],"
            " at_least: 3, within_minutes: 1440}]}, then: {classification: hardware, action: drain}}\n"
        ),
        "p.yaml",
    )
    assert policy.lookback().total_seconds() == 1440 * 60
    assert "xid" in policy.context_kinds()
