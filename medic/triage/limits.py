"""Each node group's own guardrails over a replay (`medic triage`, `medic policy replay`)."""

from __future__ import annotations

from datetime import datetime

from medic.incidents import Scope
from medic.policy import Policy, groups, guardrails
from medic.policy.guardrails import Acting
from medic.triage.fleet import ReplayedFleet


class GroupLimits:
    """Each node group's own guardrails, held over the decisions on its own nodes as a replay's
    decisions so far would have left them, after the policy's over the fleet (as `check_rails` in
    medic/tasks/nodes/evidence.py holds them live). How many nodes a group has is the scheduler's to say: only
    the count limits apply."""

    def __init__(self, policy: Policy) -> None:
        self.rails = {g.name: r for g in policy.groups if (r := groups.group_rails(policy, g)) is not None}
        self.fleets = {name: ReplayedFleet(None) for name in self.rails}

    def check(
        self, group: str | None, now: datetime, opened: datetime, node: str, decision: Acting, scope: Scope
    ) -> tuple[str, str] | None:
        """The first of the group's limits the decision would break, as (name, why); None when all hold."""
        rails = self.rails.get(group) if group is not None else None
        if group is None or rails is None:
            return None
        hit = guardrails.check(rails, self.fleets[group].state(now, opened), node, decision, scope)
        return (hit[0], f"{hit[1]} in group {group}") if hit else None

    def record(self, group: str | None, node: str, now: datetime, decision: Acting) -> None:
        fleet = self.fleets.get(group) if group is not None else None
        if fleet is not None:
            fleet.record(node, now, decision)
