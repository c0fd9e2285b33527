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

from medic.policy import Action, Decision
from tasks.decide import decide_incident
from tasks.diagnose import LEVEL_BUDGET_S, diagnose
from tasks.runtime import current

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
        level = decision.diagnose_level
        # Each level has its own hard budget: a hung DCGM run must not hold the incident forever.
        budgeted = diagnose.with_options(timeout_seconds=LEVEL_BUDGET_S[level] + 60)
        result = budgeted(incident_id, node, level)
        if result.guardrail:
            # The drain for this level was refused at the last check: nothing ran, the node is as it was.
            seen.append(f"L{level} not run (guardrail {result.guardrail})")
            stopped = decision.model_copy(
                update={
                    "action": Action.ESCALATE,
                    "diagnose_level": None,
                    "guardrail": result.guardrail,
                    "blocked_action": Action.DIAGNOSE,
                    "reason": f"{decision.reason}; diagnose stopped by guardrail {result.guardrail} "
                    f"at the last check: {result.detail}",
                }
            )
            rt = current()
            rt.store.add_decision(stopped, rt.policy().path)  # the audit names the guardrail
            return LadderResult(decision=stopped, seen=seen)
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
