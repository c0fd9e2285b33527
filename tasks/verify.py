"""Verify and reintegrate: a node comes back only after it passes the policy's verification level."""

from __future__ import annotations

from prefect import task
from pydantic import BaseModel

from medic.errors import PermanentError
from medic.statuses import StepStatus
from tasks.evidence import record_diagnostic
from tasks.node_ops import resume_node
from tasks.retry import transient_only
from tasks.runtime import current
from tasks.stage import stage


class VerifyOutcome(BaseModel):
    passed: bool
    detail: str


@task(
    name="verify",
    task_run_name="verify L{level} {node}",
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=transient_only,
    timeout_seconds=3600,
)
def verify(incident_id: str, node: str, level: int, ready_timeout_s: float = 1800) -> VerifyOutcome:
    rt = current()
    with stage(rt.store, incident_id, f"verify L{level}", node=node) as log:
        try:
            back = rt.backends.provider.wait_ready(node, ready_timeout_s)
            gone = f"{node} did not come back"
        except PermanentError as error:  # e.g. never seen going down: the action is unconfirmed
            back, gone = False, str(error)
        if not back:
            outcome = VerifyOutcome(passed=False, detail=f"{gone}; kept out of service")
        else:
            result = rt.backends.diagnostics.run(node, level, timeout_s=600)
            record_diagnostic(rt, incident_id, result, note="verification: ")
            if result.result == "pass":
                outcome = VerifyOutcome(
                    passed=True, detail=f"DCGM level {level} passed; {resume_node(rt, incident_id, node)}"
                )
            else:
                outcome = VerifyOutcome(
                    passed=False,
                    detail=f"DCGM level {level} {result.result} after repair; kept out of service",
                )
        log.done(outcome.detail, status=StepStatus.OK if outcome.passed else StepStatus.FAILED)
        return outcome
