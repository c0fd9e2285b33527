"""A sweep's steps: plan from the store and the scheduler, then for each picked node hold it with a
reservation (under the guardrail slot), run the DCGM level and release it whatever happened.

Each node's step is recorded under the sweep's id (`sweep-...`) in the store, as an incident's steps
are, and its DCGM run as a diagnostic of that id: `medic incident sweep-...` shows what a sweep did,
and the run counts as the node's last deep check for the next plan.
"""

from __future__ import annotations

import math
import uuid
from datetime import datetime, timedelta
from typing import Literal

from prefect import task
from pydantic import BaseModel

from medic.ageing import assess
from medic.errors import MedicError, PermanentError
from medic.events import EventKind, FaultEvent
from medic.policy import Action, Decision
from medic.policy.model import Classification
from medic.protocols import DiagnosticResult, Reservations
from medic.statuses import StepStatus
from medic.store import utcnow
from medic.sweep import DIAGNOSTIC_PREFIX, NodeBusyError, SweepPlan, SweepSettings, plan
from medic.tasks.diagnose import LEVEL_BUDGET_S
from medic.tasks.nodes.evidence import fleet_state, record_diagnostic
from medic.tasks.nodes.guard import guarded
from medic.tasks.runtime.process import Runtime, current
from medic.tasks.runtime.stage import run_logger, stage

HEALTH_WINDOW = timedelta(days=30)  # the ageing evidence a plan weighs, as `medic fleet health`'s default
# A reservation outlives the level's budget by this much: a check that ends late never runs unheld.
RESERVATION_MARGIN_MIN = 5
SOURCE = "medic-sweep"  # the source of the fault event a failing sweep hands to remediation


class NoReservationsError(PermanentError):
    """Raised when the scheduler cannot hold nodes: a sweep without a reservation could have a job
    land on the node mid-check, so nothing is swept (fail closed)."""

    def __init__(self, scheduler: object) -> None:
        super().__init__(
            f"the scheduler ({type(scheduler).__name__}) has no reservations: sweeps need one that "
            "can hold idle nodes (Slurm, or the simulation); nothing is swept"
        )


class NodeSwept(BaseModel):
    node: str
    # pass | fail | error: DCGM's verdict; busy: a job took the node first; stopped: a guardrail
    # refused at the last check. Neither of the last two ran anything.
    result: Literal["pass", "fail", "error", "busy", "stopped"]
    level: int
    reservation: str | None = None
    error_ids: list[str] = []
    worst_severity: str | None = None
    detail: str = ""
    finished_at: datetime | None = None


def reservations_of(rt: Runtime) -> Reservations:
    held = rt.backends.reservations
    if held is None:
        raise NoReservationsError(rt.backends.scheduler)
    return held


def new_sweep_id(now: datetime) -> str:
    return f"sweep-{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


def reservation_minutes(settings: SweepSettings) -> int:
    budget = math.ceil(LEVEL_BUDGET_S[settings.level] / 60) + RESERVATION_MARGIN_MIN
    return max(settings.reservation_minutes, budget)


def make_plan(rt: Runtime, settings: SweepSettings, now: datetime | None = None) -> SweepPlan:
    """The plan as of now: the scheduler's nodes, the store's ageing evidence and deep checks, the
    policy's guardrails with every node out of service (our reservations included)."""
    reserved = reservations_of(rt).reserved_nodes()
    now = now or utcnow()
    policy = rt.policy().policy
    nodes = rt.backends.scheduler.nodes()
    since = now - HEALTH_WINDOW
    health = assess(rt.store.past_incidents(since, now), rt.store.counter_readings(since, now), since, now)
    state = fleet_state(rt, policy, now, nodes)
    return plan(nodes, health, rt.store.last_deep_checks(), policy.guardrails, state, settings, reserved)


def _intent(sweep_id: str, node: str, level: int) -> Decision:
    """What the guardrails are asked at the last check: holding the node takes it out like a drain."""
    return Decision(
        incident=sweep_id,
        classification=Classification.UNKNOWN,
        action=Action.DRAIN,
        rule="sweep",
        reason=f"sweep {sweep_id}: {node} held for DCGM level {level}",
    )


def fault_event(sweep_id: str, swept: NodeSwept) -> FaultEvent:
    """A failing sweep result as the fault event remediation decides on, like any diagnostic's."""
    finished = swept.finished_at or utcnow()
    return FaultEvent(
        id=f"{sweep_id}-{swept.node}-dcgm-l{swept.level}",
        time=finished,
        source=SOURCE,
        kind=EventKind.DIAGNOSTIC,
        node=swept.node,
        attributes={
            "level": swept.level,
            "result": swept.result,
            "error_ids": swept.error_ids,
            "sweep": sweep_id,
            **({"worst_severity": swept.worst_severity} if swept.worst_severity else {}),
        },
    )


def _swept(result: DiagnosticResult, reservation: str) -> NodeSwept:
    return NodeSwept(
        node=result.node,
        result=result.result if result.result in ("pass", "fail") else "error",
        level=result.level,
        reservation=reservation,
        error_ids=list(result.error_ids),
        worst_severity=result.worst_severity,
        detail=result.detail,
        finished_at=result.finished_at,
    )


@task(name="sweep-node", task_run_name="sweep L{level} {node}")
def sweep_node(sweep_id: str, node: str, level: int, minutes: int) -> NodeSwept:
    """Hold `node`, run DCGM `level` on it, release it. Not retried: a second run would hold the node
    again for a verdict the store already has, or for one that errored the same way."""
    rt = current()
    held = reservations_of(rt)
    log = run_logger()
    with stage(rt.store, sweep_id, f"sweep L{level}", node=node) as step:
        with guarded(rt, node, _intent(sweep_id, node, level)) as stopped:
            if stopped is not None:
                why = f"not held: guardrail {stopped[0]}: {stopped[1]}"
                step.done(why, status=StepStatus.SKIPPED, level=level, guardrail=stopped[0])
                return NodeSwept(node=node, result="stopped", level=level, detail=why)
            try:
                name = held.reserve([node], minutes, f"GPU Medic {sweep_id}: DCGM level {level}")
            except NodeBusyError as error:
                step.done(f"not held: {error}", status=StepStatus.SKIPPED, level=level)
                return NodeSwept(node=node, result="busy", level=level, detail=str(error))
        log.info("sweep %s: %s held by reservation %s for %d min", sweep_id, node, name, minutes)
        try:
            result = rt.backends.diagnostics.run(node, level, timeout_s=LEVEL_BUDGET_S[level])
        finally:
            released = _release(held, name)
            log.info("sweep %s: reservation %s on %s %s", sweep_id, name, node, released)
        record_diagnostic(rt, sweep_id, result, note=DIAGNOSTIC_PREFIX)
        swept = _swept(result, name)
        errors = f" ({', '.join(swept.error_ids)})" if swept.error_ids else ""
        step.done(
            f"DCGM level {level} {swept.result}{errors}; reservation {name} {released}",
            status=StepStatus.FAILED if swept.result == "error" else StepStatus.OK,
            level=level,
            reservation=name,
            error_ids=swept.error_ids,
        )
        return swept


def _release(held: Reservations, name: str) -> str:
    """Release the reservation; one that cannot be released now still ends at its Duration, and it
    counts against the guardrails until then, so the failure is reported, not raised over the verdict."""
    try:
        held.release(name)
    except MedicError as error:
        run_logger().error("reservation %s not released (it expires on its own): %s", name, error)
        return f"NOT released ({error}); it expires on its own"
    return "released"
