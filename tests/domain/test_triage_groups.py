"""`medic triage`'s replay decides each incident in its node's group and mode, as the live path does
(decision 0017): a group's own rules and limits, observe deciding without taking the node out, and a
node whose group cannot be told from what triage knows escalated with the reason."""

from __future__ import annotations

from factories import fault_event
from groups_support import GROUPS, grouped_text

from medic.events import FaultEvent
from medic.policy import Action, LoadedPolicy, Mode
from medic.policy.groups import observed
from medic.policy.loader import parse_policy
from medic.protocols import NodeInfo, NodeState
from medic.triage import Replayed, replay


def grouped(groups: str = GROUPS) -> LoadedPolicy:
    return LoadedPolicy(parse_policy(grouped_text(groups), "grouped.yaml"), "grouped.yaml", "ab" * 32)


def xid79(node: str, minutes: float = 0) -> FaultEvent:
    return fault_event(node=node, gpu=0, minutes=minutes, attributes={"code": 79})


def by_node(results: list[Replayed]) -> dict[str, Replayed]:
    return {r.incident.node: r for r in results}


def test_each_node_is_decided_with_its_groups_rules_and_mode() -> None:
    results = by_node(list(replay([xid79("gpu-node-1"), xid79("gpu-node-3", 30)], grouped())))
    watched, fixed = results["gpu-node-1"].decision, results["gpu-node-3"].decision
    # The observe group's own rule wins on its node, and is what would have been done.
    assert (watched.rule, watched.action, watched.mode, watched.group) == (
        "watch-drain-first",
        Action.DRAIN,
        Mode.OBSERVE,
        "watch",
    )
    assert observed(watched)
    # The remediate group has no rule of its own: the policy's, acted on.
    assert (fixed.rule, fixed.action, fixed.mode, fixed.group) == (
        "xid-fallen-off-bus",
        Action.REBOOT,
        Mode.REMEDIATE,
        "fix",
    )
    assert not observed(fixed)
    assert (
        results["gpu-node-3"].placement.why
        == "gpu-node-3 is in group fix (gpu-node-3 is in hostlist gpu-node-[3-4])"
    )


def test_a_node_whose_group_needs_a_fact_triage_lacks_is_left_alone_and_escalated() -> None:
    (result,) = replay([xid79("gpu-node-5")], grouped())
    decision = result.decision
    assert (decision.action, decision.blocked_action, decision.mode, decision.group) == (
        Action.ESCALATE,
        Action.REBOOT,
        Mode.OBSERVE,
        None,
    )
    problem = "cannot tell whether gpu-node-5 is in group racks: the scheduler gives no features for it"
    assert result.placement.problem == problem
    assert f"node group undecidable: {problem}; nothing done, handed to people" in decision.reason


def test_what_the_scheduler_says_of_a_node_places_it() -> None:
    rack = NodeInfo(name="gpu-node-5", state=NodeState.IDLE, features=("nvl72", "ib"))
    (result,) = replay([xid79("gpu-node-5")], grouped(), nodes=[rack])
    # In the contain group: the reboot waits for a human's approval.
    assert (result.decision.action, result.decision.mode, result.decision.group) == (
        Action.REBOOT,
        Mode.CONTAIN,
        "racks",
    )
    assert result.decision.approve
    plain = NodeInfo(name="gpu-node-5", state=NodeState.IDLE, features=("ib",))
    (result,) = replay([xid79("gpu-node-5")], grouped(), nodes=[plain])
    assert (result.decision.action, result.decision.mode, result.decision.group) == (
        Action.REBOOT,
        Mode.REMEDIATE,
        None,
    )


def test_an_observed_drain_leaves_the_node_in_service_for_the_fleets_limits() -> None:
    """With 10 nodes the default policy lets one out of service: the watched node's drain was only
    said, so the next node's reboot goes ahead; had it been carried out, the limit would stop it."""
    events = [xid79("gpu-node-1"), xid79("gpu-node-3", 30)]
    results = by_node(list(replay(events, grouped(), fleet_size=10)))
    assert results["gpu-node-3"].decision.action is Action.REBOOT
    acting = grouped(GROUPS.replace("mode: observe", "mode: remediate"))
    results = by_node(list(replay(events, acting, fleet_size=10)))
    assert results["gpu-node-1"].decision.action is Action.DRAIN
    stopped = results["gpu-node-3"].decision
    assert (stopped.action, stopped.guardrail) == (Action.ESCALATE, "max_out_of_service")


def test_a_groups_own_limit_holds_over_its_nodes_only() -> None:
    events = [xid79("gpu-node-3"), xid79("gpu-node-4", 30), xid79("gpu-node-7", 40)]
    results = by_node(list(replay(events, grouped())))
    assert results["gpu-node-3"].decision.action is Action.REBOOT
    second = results["gpu-node-4"].decision
    assert (second.action, second.guardrail) == (Action.ESCALATE, "max_destructive_per_hour")
    assert "1 destructive actions in the last hour (limit 1) in group fix" in second.reason
    # A node of no group is held to the policy's limits alone (20 an hour).
    assert results["gpu-node-7"].decision.action is Action.REBOOT
    assert results["gpu-node-7"].placement.group is None
