"""Rebuilding an incident from the store and deciding on it: shared by triage, the ladder and decide."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

from medic.ageing import PastIncident
from medic.context import Context
from medic.facts import HISTORY_WINDOW, facts_of
from medic.incidents import Incident, Scope, Storms
from medic.policy import Decision, Mode, decide, groups, guardrails
from medic.policy.guardrails import HOUR, FleetState
from medic.policy.model import DESTRUCTIVE, Guardrails, Policy
from medic.protocols import DiagnosticResult, NodeInfo
from medic.store import utcnow
from medic.store.tables import DiagnosticRecord
from medic.tasks.runtime.process import Runtime
from medic.whatif.replay import record_facts

# Replicas' clocks differ a little: a drain recorded just before a snapshot's read by another
# machine's clock must still be added to it.
CLOCK_SKEW = timedelta(seconds=2)


def load_incident(rt: Runtime, incident_id: str) -> Incident:
    record = rt.store.get_incident(incident_id)
    if record is None:
        raise LookupError(f"incident {incident_id} is not in the store")
    events = rt.store.incident_events(incident_id)
    scope: Scope = "switch" if record.scope == "switch" else "node"
    incident = Incident(id=incident_id, node=record.node, events=events, scope=scope)
    if incident.scope == "switch":
        return incident  # a switch has no remediation history of its own
    # History before this incident only: our own actions for it are not "repeat" evidence.
    since = utcnow() - HISTORY_WINDOW - timedelta(hours=1)
    incident.history = [
        h for h in rt.store.node_history(record.node, since) if h.attributes.get("incident") != incident_id
    ]
    return incident


def gpu_history(rt: Runtime, incident: Incident, policy: Policy, now: datetime) -> tuple[PastIncident, ...]:
    """The node's earlier incidents that named a GPU, as far back as the policy's `gpu_incidents`
    conditions look; none when no rule has one (and no query)."""
    reach = policy.gpu_history_lookback()
    if not reach or incident.scope != "node":
        return ()
    past = rt.store.past_incidents(now - reach, until=now, node=incident.node)
    return tuple(p for p in past if p.gpus and p.id != incident.id)


def record_diagnostic(rt: Runtime, incident_id: str, result: DiagnosticResult, note: str = "") -> None:
    rt.store.add_diagnostic(
        DiagnosticRecord(
            incident_id=incident_id,
            node=result.node,
            level=result.level,
            result=result.result,
            error_ids=list(result.error_ids),
            started_at=result.started_at or utcnow(),
            finished_at=result.finished_at or utcnow(),
            detail=f"{note}{result.detail}",
        )
    )


def switch_sizes(nodes: list[NodeInfo]) -> Counter[str]:
    return Counter(n.switch for n in nodes if n.switch)


def storms(rt: Runtime) -> Storms:
    """What makes one switch-wide incident now: the policy's switch conditions, the scheduler's switches."""
    return rt.policy().policy.storms(switch_sizes(rt.fleet().nodes))


def counted_out_of_service(nodes: list[NodeInfo], *, by_others: bool) -> frozenset[str]:
    """The nodes `max_out_of_service*` counts: every node out of service as the scheduler shows it
    (drained, down or rebooting, for any reason), or with `by_others` off only the ones we drained."""
    if by_others:
        return frozenset(n.name for n in nodes if n.out_of_service)
    return frozenset(n.name for n in nodes if n.drained_by_medic)


def fleet_state(
    rt: Runtime,
    policy: Policy,
    now: datetime,
    nodes: list[NodeInfo],
    incident_id: str | None = None,
    rails: Guardrails | None = None,
    since: datetime | None = None,
) -> FleetState:
    """The fleet as the guardrails must see it: the scheduler's nodes and our recorded actions.

    For a decision on `incident_id`, that incident's own destructive actions are not counted: one
    its earlier run carried out before it died is the same fault's action, which `act` finds done
    and never repeats, not another that the hourly cap and the node's cooldown hold back. With a
    group's `rails`, `nodes` are the group's and only actions on them count. With `since`, when
    `nodes` were read (a snapshot, medic/tasks/runtime/fleet_snapshot.py), the nodes GPU Medic took out from then on
    count as out of service too: the store has them before the scheduler's next read does."""
    rails = rails or policy.guardrails
    names = frozenset(n.name for n in nodes)
    cooldown = timedelta(minutes=rails.node_cooldown_minutes or 0)
    destructive = [
        a
        for a in rt.store.actions_since(now - max(HOUR, cooldown), [a.value for a in DESTRUCTIVE])
        if (incident_id is None or a.incident_id != incident_id)
        and (rails is policy.guardrails or a.node in names)
    ]
    window = timedelta(minutes=rails.circuit_breaker.window_minutes if rails.circuit_breaker else 0)
    drains = rt.store.actions_since(now - window, ["drain"])
    # A sweep's reservation keeps jobs off its nodes as a drain does, though the scheduler shows
    # them idle: they count, so that remediation and sweeps together stay within the limits.
    reservations = rt.backends.reservations
    reserved = reservations.reserved_nodes() if reservations is not None else frozenset()
    if rails is not policy.guardrails:
        reserved = reserved & names
    taken: frozenset[str] = frozenset()
    if since is not None:
        recent = rt.store.taken_out_since(since - CLOCK_SKEW)
        taken = frozenset(recent if rails is policy.guardrails else recent & names)
    return FleetState(
        now=now,
        fleet_size=len(nodes),
        out_of_service=reserved
        | taken
        | counted_out_of_service(nodes, by_others=rails.count_out_of_service_by_others),
        destructive_at=tuple(a.intent_at for a in destructive),
        last_destructive={a.node: a.intent_at for a in destructive},
        taken_out_at={a.node: a.intent_at for a in drains},
        breaker_open=rt.store.open_breaker_record() is not None,
    )


def check_rails(
    rt: Runtime,
    policy: Policy,
    now: datetime,
    nodes: list[NodeInfo],
    node: str,
    decision: Decision,
    scope: Scope = "node",
    since: datetime | None = None,
) -> tuple[FleetState, tuple[str, str] | None]:
    """The fleet's state and the first guardrail the decision would break: the policy's over the
    fleet, then those of the node's group, as the scheduler shows the node now, over the group's
    nodes (medic/policy/groups.py). `since`: when `nodes` were read, as `fleet_state` takes it."""
    state = fleet_state(rt, policy, now, nodes, decision.incident, since=since)
    stopped = guardrails.check(policy.guardrails, state, node, decision, scope)
    info = next((n for n in nodes if n.name == node), None) or groups.unknown_node(node)
    group = groups.place(policy, info).group if policy.groups else None
    rails = groups.group_rails(policy, group)
    if stopped is not None or group is None or rails is None:
        return state, stopped
    inside = groups.members(group, nodes)
    mine = fleet_state(
        rt, policy, now, [n for n in nodes if n.name in inside], decision.incident, rails, since
    )
    hit = guardrails.check(rails, mine, node, decision, scope)
    return state, (hit[0], f"{hit[1]} in group {group.name}") if hit else None


def evaluate(rt: Runtime, incident_id: str) -> Decision:
    """Decide on the incident as the store knows it now, with the policy file as it is now, and the
    node's group as the scheduler shows the node now."""
    incident = load_incident(rt, incident_id)
    loaded = rt.policy()
    policy = loaded.policy
    now = utcnow()
    fleet = rt.fleet()
    nodes = fleet.nodes
    placement = groups.place_all(
        policy, incident.nodes if incident.scope == "switch" else [incident.node], nodes
    )
    around = policy.around(incident.events, incident.node, incident.switch)
    context = Context(
        rt.store.events_between(now - policy.lookback(), now, around),
        switch_sizes=switch_sizes(nodes),
        fleet_size=len(nodes),
    )
    out_of_service = incident.scope == "node" and rt.backends.scheduler.node(incident.node).drained_by_medic
    facts = facts_of(
        incident,
        out_of_service=out_of_service,
        now=now,
        context=context,
        gpu_history=gpu_history(rt, incident, policy, now),
    )
    decided = decide(groups.policy_for(policy, placement.group), facts, loaded.sha256)
    state, stopped = check_rails(
        rt, policy, now, nodes, incident.node, decided, incident.scope, since=fleet.read_at
    )
    decision = groups.in_mode(guardrails.stop(decided, stopped) if stopped else decided, placement)
    guard = (decision.guardrail, decision.reason) if decision.guardrail else None
    if placement.mode is not Mode.OBSERVE:  # a node only watched never opens the fleet's breaker
        record_breaker_trip(rt, state, guard, incident_id)
    rt.store.add_decision(decision, loaded.path, facts=record_facts(facts))
    return decision


def record_breaker_trip(
    rt: Runtime, state: FleetState, stopped: tuple[str, str] | None, incident_id: str
) -> None:
    """Open the breaker when a check finds it tripped, wherever that check ran: a trip seen only
    at the last check before an action is as real as one seen when deciding."""
    if stopped is not None and stopped[0] == "circuit_breaker" and not state.breaker_open:
        rt.store.open_breaker(stopped[1], incident_id)
