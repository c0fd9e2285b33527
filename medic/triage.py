"""`medic triage`: events in, one decision per incident out, nothing acted on. No Prefect needed.

The JSON form of `TriageLine` is a public contract (docs/triage.md); tests pin it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict

from medic.context import Context
from medic.events import FaultEvent
from medic.facts import Facts, facts_of, taken_out_by_us
from medic.incidents import Incident, correlate
from medic.policy import LoadedPolicy, decide, guardrails
from medic.policy.guardrails import HOUR, FleetState, takes_node_out
from medic.policy.model import DESTRUCTIVE, Action, Decision


class TriageLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    incident: str
    nodes: list[str]
    classification: Literal["hardware", "software", "infrastructure", "unknown"]
    action: Literal["none", "diagnose", "reset_gpu", "reboot", "replace", "drain", "reintegrate", "escalate"]
    diagnose_level: int | None
    rule: str
    reason: str


def triage_line(incident: Incident, decision: Decision) -> TriageLine:
    return TriageLine(
        incident=incident.id,
        nodes=incident.nodes,
        classification=decision.classification.value,
        action=decision.action.value,
        diagnose_level=decision.diagnose_level,
        rule=decision.rule,
        reason=decision.reason,
    )


@dataclass(slots=True)
class _ReplayedFleet:
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
        # replay of a week of events linear. The snapshot shares the dicts (it is only read).
        self.destructive_at = [at for at in self.destructive_at if at >= opened - HOUR]
        return FleetState(
            now=now,
            fleet_size=self.fleet_size,
            out_of_service=frozenset(self.out_of_service),
            destructive_at=tuple(self.destructive_at),
            last_destructive=self.last_destructive,
            taken_out_at=self.taken_out_at,
            breaker_open=self.breaker_open,
        )

    def record(self, node: str, now: datetime, decision: Decision) -> None:
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


@dataclass(frozen=True, slots=True)
class Replayed:
    incident: Incident
    facts: Facts
    decision: Decision


def replay(
    events: Iterable[FaultEvent], loaded: LoadedPolicy, fleet_size: int | None = None
) -> Iterator[Replayed]:
    """Decide on each incident in time order, as the flows would, without acting.

    Cross-node conditions see every event of the input; guardrails see the fleet as the earlier
    decisions would have left it. Without `fleet_size` only the count limits apply.
    """
    events = list(events)
    policy = loaded.policy
    context = Context(events, fleet_size=fleet_size)
    fleet = _ReplayedFleet(fleet_size)
    window = timedelta(minutes=policy.defaults.incident_window_minutes)
    for incident in correlate(events, window, policy.storms()):
        now = incident.last_at
        # Out of service as the earlier decisions would have left it, or as the input records it:
        # a drain or reboot of ours that nothing returned, as the live path reads the scheduler.
        out = incident.node in fleet.out_of_service or taken_out_by_us(incident.history)
        facts = facts_of(incident, out_of_service=out, context=context)
        decision = guardrails.apply(
            policy.guardrails,
            fleet.state(now, incident.opened_at),
            incident.node,
            decide(policy, facts, loaded.sha256),
            incident.scope,
        )
        fleet.record(incident.node, now, decision)
        yield Replayed(incident, facts, decision)


def triage(
    events: Iterable[FaultEvent], loaded: LoadedPolicy, fleet_size: int | None = None
) -> Iterator[tuple[Incident, Decision]]:
    for replayed in replay(events, loaded, fleet_size):
        yield replayed.incident, replayed.decision
