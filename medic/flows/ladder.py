"""The diagnostic ladder: climb DCGM levels only as far as the evidence needs (a subflow).

The policy says where to start; after each level the incident is decided again with the new
result as evidence, so the ladder stops at the first conclusive answer. A level that already
ran for the incident never runs again: re-entering with new evidence continues from there.
Cancelling the subflow run (Prefect UI or API) stops the climb between levels.
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel

from medic.policy import Action, Decision, Mode
from medic.tasks.decide import decide_incident
from medic.tasks.diagnose import LEVEL_BUDGET_S, DiagnosticOutcome, diagnose
from medic.tasks.resume import MOVE_WAIT_S
from medic.tasks.runtime.process import current

MAX_STEPS = 4


class LadderResult(BaseModel):
    decision: Decision
    seen: list[str]  # "L1 pass", "L2 fail (DCGM_FR_FAULTY_MEMORY)"


def _run_name() -> str:
    params = flow_run.parameters
    return f"{params['incident_id']}-{params['node']}-dcgm"


@flow(name="diagnose-ladder", flow_run_name=_run_name, persist_result=False)
async def diagnose_ladder(incident_id: str, node: str, decision: Decision) -> LadderResult:
    seen: list[str] = []
    for _ in range(MAX_STEPS):
        if decision.action is not Action.DIAGNOSE or decision.diagnose_level is None:
            break
        if decision.mode is Mode.OBSERVE:
            break  # the policy was switched to observe meanwhile: no more diagnostics on the node
        level = decision.diagnose_level
        # Each level has its own hard budget: a hung DCGM run must not hold the incident forever.
        # From level 2 on it also covers moving the node's jobs off first.
        moving = MOVE_WAIT_S if level >= 2 else 0
        budgeted = diagnose.with_options(timeout_seconds=LEVEL_BUDGET_S[level] + moving + 60)
        result = budgeted(incident_id, node, level)
        if result.result == "stopped":
            seen.append(f"L{level} not run ({_not_run_why(result)})")
            return LadderResult(decision=_stopped(decision, result), seen=seen)
        errors = f" ({', '.join(result.error_ids)})" if result.error_ids else ""
        seen.append(f"L{result.level} {result.result}{errors}")
        if result.result == "error":
            # No verdict about the GPU: climbing further would only repeat the failure.
            escalated = decision.model_copy(
                update={
                    "action": Action.ESCALATE,
                    "reason": f"{decision.reason}; DCGM could not run: {result.detail}",
                }
            )
            return LadderResult(decision=escalated, seen=seen)
        decision = decide_incident(incident_id)
    return LadderResult(decision=decision, seen=seen)


def _not_run_why(result: DiagnosticOutcome) -> str:
    return f"guardrail {result.guardrail}" if result.guardrail else "a job still on the node"


def _stopped(decision: Decision, result: DiagnosticOutcome) -> Decision:
    """Escalate a level that did not run, and record why: the audit names the guardrail that refused
    the drain, or the job that could not be moved off the drained node."""
    why = (
        f"diagnose stopped by guardrail {result.guardrail} at the last check: {result.detail}"
        if result.guardrail
        else f"diagnose not run, node held out of service: {result.detail}"
    )
    stopped = decision.model_copy(
        update={
            "action": Action.ESCALATE,
            "diagnose_level": None,
            "guardrail": result.guardrail,
            "blocked_action": Action.DIAGNOSE,
            "reason": f"{decision.reason}; {why}",
        }
    )
    rt = current()
    rt.store.add_decision(stopped, rt.policy().path)
    return stopped
