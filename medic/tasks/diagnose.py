"""Diagnose: run one DCGM level on the node and add its verdict to the incident's evidence."""

from __future__ import annotations

from prefect import task
from pydantic import BaseModel

from medic.events import FaultEvent
from medic.policy import Action, Decision
from medic.policy.model import Classification
from medic.statuses import StepStatus
from medic.store import utcnow
from medic.tasks.nodes.evidence import record_diagnostic
from medic.tasks.nodes.service import take_out_of_service
from medic.tasks.resume import move_jobs_off
from medic.tasks.runtime.process import Runtime, current
from medic.tasks.runtime.retry import transient_only
from medic.tasks.runtime.stage import StageLog, stage

# Hard time budget per DCGM level (seconds): L1 takes seconds, L4 up to two hours.
LEVEL_BUDGET_S: dict[int, float] = {1: 120, 2: 900, 3: 2700, 4: 9000}


class DiagnosticOutcome(BaseModel):
    level: int
    # pass | fail | error | stopped (nothing ran: a guardrail refused the drain, or a job could not
    # be moved off the drained node)
    result: str
    error_ids: list[str]
    detail: str
    guardrail: str | None = None  # the guardrail that refused the drain, when that stopped it


def drain_intent(incident_id: str, level: int) -> Decision:
    """What the guardrails are asked about before a level 2-4 run: a `diagnose` that takes the node out."""
    return Decision(
        incident=incident_id,
        classification=Classification.UNKNOWN,
        action=Action.DIAGNOSE,
        diagnose_level=level,
        rule="dcgm-ladder",
        reason=f"DCGM level {level} needs the node drained",
    )


def _clear_node(
    rt: Runtime, incident_id: str, node: str, level: int, log: StageLog
) -> str | DiagnosticOutcome:
    """Levels 2-4 stress the GPUs: nothing else may run on them. The node goes out of service, through
    the same guardrail check under the slot as any other drain, then its jobs are moved off. Returns
    what was done, or the "stopped" outcome when either could not happen (the level does not run)."""
    taken = take_out_of_service(
        rt, incident_id, node, drain_intent(incident_id, level), f"DCGM level {level}"
    )
    if taken.stopped:
        log.done(f"DCGM level {level} not run: {taken.detail}", status=StepStatus.SKIPPED, level=level)
        return DiagnosticOutcome(
            level=level, result="stopped", error_ids=[], detail=taken.stopped[1], guardrail=taken.guardrail
        )
    off = move_jobs_off(rt, incident_id, node)
    if off.stuck:
        # Fail closed: no stress test beside a job; the node stays drained for the humans it goes to.
        log.done(
            f"DCGM level {level} not run: {off.stuck}; {node} held out of service",
            status=StepStatus.SKIPPED,
            level=level,
        )
        return DiagnosticOutcome(level=level, result="stopped", error_ids=[], detail=off.stuck)
    return "; ".join(p for p in (taken.detail, off.detail) if p)


@task(
    name="diagnose",
    task_run_name="diagnose L{level} {node}",
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=transient_only,
)
def diagnose(incident_id: str, node: str, level: int) -> DiagnosticOutcome:
    rt = current()
    with stage(rt.store, incident_id, f"diagnose L{level}", node=node) as log:
        drained = None
        if level >= 2:
            cleared = _clear_node(rt, incident_id, node, level, log)
            if isinstance(cleared, DiagnosticOutcome):
                return cleared
            drained = cleared
        result = rt.backends.diagnostics.run(node, level, timeout_s=LEVEL_BUDGET_S[level])
        record_diagnostic(rt, incident_id, result)
        finished = result.finished_at or utcnow()
        if result.result in ("pass", "fail"):
            rt.store.add_event(
                FaultEvent(
                    id=f"{incident_id}-dcgm-l{level}-{finished.strftime('%Y%m%dT%H%M%S%f')}",
                    time=finished,
                    source="medic",
                    kind="diagnostic",
                    node=node,
                    attributes={
                        "level": level,
                        "result": result.result,
                        "error_ids": list(result.error_ids),
                        **({"worst_severity": result.worst_severity} if result.worst_severity else {}),
                    },
                ),
                incident_id,
            )
        log.done(
            f"DCGM level {level} {result.result}"
            + (f" ({', '.join(result.error_ids)})" if result.error_ids else "")
            + (f"; {drained}" if drained else ""),
            status=StepStatus.OK if result.result != "error" else StepStatus.FAILED,
            level=level,
            error_ids=list(result.error_ids),
        )
        return DiagnosticOutcome(
            level=level, result=result.result, error_ids=list(result.error_ids), detail=result.detail
        )
