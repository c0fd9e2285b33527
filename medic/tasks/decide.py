"""Decide: the policy's final answer once the evidence (diagnostics included) is in."""

from __future__ import annotations

from prefect import task

from medic.policy import Decision
from medic.tasks.nodes.evidence import evaluate
from medic.tasks.runtime.process import current
from medic.tasks.runtime.retry import transient_only
from medic.tasks.runtime.stage import stage


@task(
    name="decide",
    task_run_name="decide {incident_id}",
    timeout_seconds=30,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient_only,
)
def decide_incident(incident_id: str) -> Decision:
    rt = current()
    with stage(rt.store, incident_id, "decide") as log:
        decision = evaluate(rt, incident_id)
        rt.store.update_incident(
            incident_id,
            classification=decision.classification.value,
            action=decision.action.value,
            rule=decision.rule,
        )
        log.done(
            f"{decision.classification.value} → {decision.action.value} by rule {decision.rule}: {decision.reason}",
            policy_sha256=decision.policy_sha256,
            matched=decision.matched,
        )
        return decision
