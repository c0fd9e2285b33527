"""What the remediation flow would do for a decision, step by step, in words (for --dry-run)."""

from __future__ import annotations

from medic.deep_check import verify_checks
from medic.policy import Action, Decision
from medic.policy.deep_checks import CheckName, DeepChecks
from medic.policy.groups import observed
from medic.policy.model import DESTRUCTIVE


def plan_steps(
    decision: Decision, node: str, incident: str, jobs: list[str], verify_level: int, deep: DeepChecks
) -> list[str]:
    action = decision.action
    if decision.guardrail:
        return [
            f"escalate: {decision.blocked_action} stopped by guardrail {decision.guardrail}",
            "notify the owner",
        ]
    if observed(decision):
        # The node's group observes: the flow says what it would have done and touches nothing.
        group = f" (group {decision.group})" if decision.group else ""
        return [f"observe mode{group}: touch nothing", f"tell the owner: would have {action.value} {node}"]
    steps: list[str] = []
    if action is Action.DIAGNOSE:
        level = decision.diagnose_level or 1
        if level >= 2:
            steps.append(f"drain {node} (reason 'medic: DCGM level {level} incident {incident}')")
        steps.append(f"run DCGM level {level} on {node}, then decide again on its result")
    elif action in DESTRUCTIVE or action is Action.DRAIN:
        steps.append(f"drain {node} (reason 'medic: {action.value} incident {incident}')")
        if action in DESTRUCTIVE:
            steps.append(f"{action.value.replace('_', ' ')} {node}")
        steps.extend(f"requeue job {job} from its last checkpoint, excluding {node}" for job in jobs)
        if action in DESTRUCTIVE:
            checks, level = verify_checks(deep, verify_level, action)
            deeper = [c.value for c in checks if c is not CheckName.DCGM]
            also = f" and its {', '.join(deeper)} checks" if deeper else ""
            steps.append(f"verify {node} at DCGM level {level}{also}, then resume it (or escalate)")
    elif action is Action.REINTEGRATE:
        steps.append(f"resume {node} if medic drained it")
    elif action is Action.ESCALATE:
        steps.append("escalate to humans; no node touched")
    else:
        steps.append(f"leave {node} alone")
    steps.append("notify the owner" + (f" ({decision.owner})" if decision.owner else ""))
    return steps
