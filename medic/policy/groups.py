"""Which group a node is in, and what that changes about a decision (docs/policy.md#groups, decision 0017).

Pure: the policy and what the scheduler says of the node go in. A node in exactly one group takes its
mode, limits, approvals and rules; a node in none takes the policy's `mode`. A node two groups take, or
one whose group turns on a fact the scheduler did not give, has no group: its decision is escalated
with the reason, and nothing is done to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from medic.policy.model import DESTRUCTIVE, Action, Approvals, Decision, Group, Guardrails, Policy
from medic.policy.selectors import Mode, least, match
from medic.protocols import NodeInfo, NodeState


@dataclass(frozen=True, slots=True)
class Placement:
    """A node's group (None: none, or none could be decided), the mode it runs in, and why."""

    node: str
    mode: Mode
    group: Group | None
    why: str
    problem: str | None = None  # why no group could be decided; the mode is then observe

    @property
    def group_name(self) -> str | None:
        return self.group.name if self.group else None


def unknown_node(name: str) -> NodeInfo:
    """A node the scheduler does not list: its name is all there is to go on."""
    return NodeInfo(name=name, state=NodeState.UNKNOWN)


def place(policy: Policy, node: NodeInfo) -> Placement:
    taken: list[tuple[Group, str]] = []
    unsure: list[tuple[Group, str]] = []
    passed: list[str] = []
    for group in policy.groups:
        found = match(group.select, node)
        why = "; ".join(found.why)
        if found.selected:
            taken.append((group, why))
        elif found.selected is None:
            unsure.append((group, why))
        else:
            passed.append(f"not {group.name}: {why}")
    problem = None
    if len(taken) > 1:
        problem = f"{node.name} fits groups {' and '.join(g.name for g, _ in taken)}"
    elif unsure:
        problem = "; ".join(
            f"cannot tell whether {node.name} is in group {g.name}: {why}" for g, why in unsure
        )
    if problem is not None:
        return Placement(node.name, Mode.OBSERVE, None, problem, problem)
    if taken:
        group, why = taken[0]
        return Placement(node.name, group.mode, group, f"{node.name} is in group {group.name} ({why})")
    shown = f" ({'; '.join(passed)})" if passed else ""
    return Placement(
        node.name, policy.mode, None, f"{node.name} is in no group{shown}: the policy's mode applies"
    )


def place_all(policy: Policy, names: Sequence[str], nodes: Sequence[NodeInfo]) -> Placement:
    """The placement of an incident's nodes: one node's own; for several (a switch-wide incident, never
    acted on node by node) the least mode among them, and their group only when they share it."""
    known = {n.name: n for n in nodes}
    placements = [place(policy, known.get(name) or unknown_node(name)) for name in names]
    if len(placements) == 1:
        return placements[0]
    groups = {p.group_name for p in placements}
    mode = least([p.mode for p in placements])
    group = placements[0].group if len(groups) == 1 else None
    problems = [p.problem for p in placements if p.problem]
    return Placement(
        ", ".join(names),
        mode,
        group,
        f"{len(placements)} nodes, {mode.value} the least mode among them",
        "; ".join(problems) or None,
    )


_effective: OrderedDict[tuple[int, str], tuple[Policy, Policy]] = OrderedDict()


def policy_for(policy: Policy, group: Group | None) -> Policy:
    """The policy a group's node is decided with: its rules after the policy's, its approvals instead.
    The same object for the same policy and group, so the engine compiles it once."""
    if group is None or (not group.rules and group.approvals is None):
        return policy
    key = (id(policy), group.name)
    hit = _effective.get(key)
    if hit is not None and hit[0] is policy:
        return hit[1]
    effective = policy.model_copy(
        update={"rules": [*policy.rules, *group.rules], "approvals": approvals_for(policy, group)}
    )
    _effective[key] = (policy, effective)
    if len(_effective) > 32:
        _effective.popitem(last=False)
    return effective


def approvals_for(policy: Policy, group: Group | None) -> Approvals:
    """The policy's approvals with what the group changes of them."""
    if group is None or group.approvals is None:
        return policy.approvals
    return policy.approvals.model_copy(update=group.approvals.model_dump(exclude_none=True))


def named(policy: Policy, name: str | None) -> Group | None:
    return next((g for g in policy.groups if g.name == name), None)


def group_rails(policy: Policy, group: Group | None) -> Guardrails | None:
    """The group's own limits, to hold over its own nodes besides the policy's; None when it has none."""
    if group is None or group.guardrails is None:
        return None
    return Guardrails(
        **group.guardrails.model_dump(),
        count_out_of_service_by_others=policy.guardrails.count_out_of_service_by_others,
    )


def members(group: Group, nodes: Sequence[NodeInfo]) -> frozenset[str]:
    """The nodes a group's limits count: those it takes, and those it may take (a fact missing), so
    that what cannot be told counts against the limit rather than for it."""
    return frozenset(n.name for n in nodes if match(group.select, n).selected is not False)


def observed(decision: Decision) -> bool:
    """Whether the decision is one to say and not carry out: a node action on a node in observe mode.
    An escalation, or leaving the node alone, is carried out in every mode: it touches nothing."""
    return decision.mode is Mode.OBSERVE and decision.action not in (Action.NONE, Action.ESCALATE)


def in_mode(decision: Decision, placement: Placement) -> Decision:
    """The decision as the node's mode lets it stand: recorded with the mode and group; escalated with
    the reason when no group could be decided; a repair made to wait for approval in contain mode.
    In observe mode the decision stays what it would have been: the flow does not act on it."""
    update: dict[str, object] = {"mode": placement.mode, "group": placement.group_name}
    action = decision.action
    if placement.problem is not None:
        update.update(
            action=Action.ESCALATE,
            diagnose_level=None,
            blocked_action=None if action in (Action.NONE, Action.ESCALATE) else action,
            reason=f"{decision.reason}; node group undecidable: {placement.problem}; nothing done, "
            "handed to people",
        )
    elif placement.mode is Mode.CONTAIN and action in DESTRUCTIVE and not decision.approve:
        update.update(
            approve=True,
            reason=f"{decision.reason}; {_whose(placement)} contain mode: the {action.value} waits for "
            "a human's approval",
        )
    return decision.model_copy(update=update)


def _whose(placement: Placement) -> str:
    return f"group {placement.group_name} is in" if placement.group else "the policy's nodes are in"
