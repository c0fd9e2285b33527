"""Verify and reintegrate: a node comes back only after it passes the policy's verification level
and, after a replacement or a repair, every deep check the policy requires for that transition
(docs/deep-checks.md). Anything short of a pass keeps it out of service."""

from __future__ import annotations

from prefect import task
from pydantic import BaseModel

from medic.deep_check import CheckResult, Verdict, overall, verify_checks
from medic.errors import PermanentError
from medic.policy import Action
from medic.policy.deep_checks import CheckName, DeepChecks
from medic.statuses import StepStatus
from medic.tasks.deep_check import all_reduce_budget_s, dcgm_check, node_budget_s, run_checks
from medic.tasks.nodes.service import holding, resume_node
from medic.tasks.nodes.spares import refill_spares
from medic.tasks.runtime.process import current
from medic.tasks.runtime.retry import transient_only
from medic.tasks.runtime.stage import stage

READY_TIMEOUT_S = 1800.0


class VerifyOutcome(BaseModel):
    passed: bool
    detail: str


def verify_budget_s(deep: DeepChecks, verify_level: int, action: Action) -> float:
    """How long verification after `action` may take: the node coming back, then its checks."""
    checks, level = verify_checks(deep, verify_level, action)
    reduce = all_reduce_budget_s(deep) if CheckName.ALL_REDUCE in checks else 0.0
    return READY_TIMEOUT_S + node_budget_s(deep, checks, level) + reduce


def _detail(results: list[CheckResult], level: int, action: Action) -> str:
    """`DCGM level 1 passed`, with the deep checks that passed or, failing, what each found."""
    dcgm = next(r for r in results if r.check is CheckName.DCGM)
    others = [r for r in results if r.check is not CheckName.DCGM]
    if overall(results) is Verdict.PASS:
        extra = f"; {', '.join(r.check.value for r in others)} passed" if others else ""
        return f"DCGM level {level} passed{extra}"
    found = [] if dcgm.passed else [f"DCGM level {level} {dcgm.measured.get('result', dcgm.verdict.value)}"]
    found += [r.line() for r in others if not r.passed]
    after = "replace" if action is Action.REPLACE else "repair"
    return f"{'; '.join(found)} after {after}"


# A failed verification leaves the node out; said so when the store holds no action of ours on it.
_KEPT = "kept out of service"


@task(
    name="verify",
    task_run_name="verify L{level} {node}",
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=transient_only,
    timeout_seconds=READY_TIMEOUT_S + 3600,  # the remediation flow sets its checks' own: verify_budget_s
)
def verify(
    incident_id: str, node: str, level: int, action: Action, ready_timeout_s: float = READY_TIMEOUT_S
) -> VerifyOutcome:
    rt = current()
    checks, level = verify_checks(rt.policy().policy.deep_checks, level, action)
    with stage(rt.store, incident_id, f"verify L{level}", node=node) as log:
        try:
            back = rt.backends.provider.wait_ready(node, ready_timeout_s)
            gone = f"{node} did not come back"
        except PermanentError as error:  # e.g. never seen going down: the action is unconfirmed
            back, gone = False, str(error)
        if not back:
            outcome = VerifyOutcome(passed=False, detail=f"{gone}; {holding(rt, incident_id, node, _KEPT)}")
        else:
            # DCGM alone is the plain verification, recorded in the diagnostics; deep checks add a
            # step each.
            results = (
                [dcgm_check(rt, incident_id, node, level, "verification: ")]
                if checks == (CheckName.DCGM,)
                else run_checks(rt, incident_id, [node], checks, level, "verification: ")
            )
            detail = _detail(results, level, action)
            passed = overall(results) is Verdict.PASS
            # Passed, the node returns (into the spare pool first, while it is short); failed, it stays
            # ours, held for people (docs/decisions/0013).
            pooled = refill_spares(rt, incident_id, node) if passed else None
            after = resume_node(rt, incident_id, node) if passed else holding(rt, incident_id, node, _KEPT)
            detail = "; ".join(p for p in (detail, pooled, after) if p)
            outcome = VerifyOutcome(passed=passed, detail=detail)
        log.done(outcome.detail, status=StepStatus.OK if outcome.passed else StepStatus.FAILED)
        return outcome
