"""The fleet as a replay's decisions so far would have left it: what the guardrails look at, held
without a scheduler (`medic triage`, `medic policy replay`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from medic.policy.guardrails import HOUR, Acting, FleetState, takes_node_out
from medic.policy.model import DESTRUCTIVE, Action


@dataclass(slots=True)
class ReplayedFleet:
    """The fleet as the decisions so far would have left it: what the guardrails look at."""

    fleet_size: int | None
    out_of_service: set[str] = field(default_factory=set)
    destructive_at: list[datetime] = field(default_factory=list)
    last_destructive: dict[str, datetime] = field(default_factory=dict)
    taken_out_at: dict[str, datetime] = field(default_factory=dict)
    breaker_open: bool = False

    def state(self, now: datetime, opened: datetime) -> FleetState:
        # Incidents come in order of opening, and every later decision happens after `opened`:
        # actions more than an hour before it can never matter again. Dropping them keeps a
        # replay of a week of events linear. The snapshot shares the set and dicts (it is only
        # read): a copy of every node out of service, per decision, would cost more than deciding.
        self.destructive_at = [at for at in self.destructive_at if at >= opened - HOUR]
        return FleetState(
            now=now,
            fleet_size=self.fleet_size,
            out_of_service=self.out_of_service,
            destructive_at=tuple(self.destructive_at),
            last_destructive=self.last_destructive,
            taken_out_at=self.taken_out_at,
            breaker_open=self.breaker_open,
        )

    def record(self, node: str, now: datetime, decision: Acting) -> None:
        if decision.guardrail == "circuit_breaker":
            self.breaker_open = True
        if takes_node_out(decision):
            self.taken_out_at[node] = now
            self.out_of_service.add(node)
        if decision.action in DESTRUCTIVE:
            self.destructive_at.append(now)
            self.last_destructive[node] = now
        if decision.action in DESTRUCTIVE or decision.action is Action.REINTEGRATE:
            # The flow verifies a repaired node and returns it; a drain or a long
            # diagnostic keeps it out until a later decision says otherwise.
            self.out_of_service.discard(node)

    def forget_taken_out_before(self, moment: datetime) -> None:
        """Drop when nodes went out before `moment`: no later decision's breaker window reaches it."""
        self.taken_out_at = {node: at for node, at in self.taken_out_at.items() if at >= moment}
