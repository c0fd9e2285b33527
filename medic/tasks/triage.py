"""Triage: who and what the incident touches, and the policy's first answer."""

from __future__ import annotations

from prefect import task
from prefect.runtime import flow_run
from pydantic import BaseModel

from medic.incidents import Scope
from medic.policy import Decision
from medic.statuses import IncidentStatus
from medic.tasks.nodes.evidence import evaluate, load_incident
from medic.tasks.runtime.process import current
from medic.tasks.runtime.retry import transient_only
from medic.tasks.runtime.stage import stage


class Triage(BaseModel):
    incident: str
    node: str  # the switch's name for a switch-wide incident
    nodes: list[str]
    scope: Scope = "node"
    subject: str  # for people: the node, or `switch leaf-3 (32 nodes)`
    gpu: int | None
    jobs: list[str]
    owner: str | None
    channel: str
    fleet_size: int
    decision: Decision


@task(
    name="triage",
    task_run_name="triage {incident_id}",
    timeout_seconds=60,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient_only,
)
def triage(incident_id: str) -> Triage:
    rt = current()
    with stage(rt.store, incident_id, "triage") as log:
        incident = load_incident(rt, incident_id)
        scheduler = rt.backends.scheduler
        switch_wide = incident.scope == "switch"
        # A switch incident's jobs are those its events name; a node's also those running on it.
        jobs = (
            incident.jobs
            if incident.jobs or switch_wide
            else [j.id for j in scheduler.jobs_on_node(incident.node)]
        )
        owner = next((info.owner for j in jobs if (info := scheduler.job(j)) and info.owner), None)
        gpu = next((e.gpu for e in incident.events if e.gpu is not None), None)
        decision = evaluate(rt, incident_id)
        # A rule may route elsewhere (network trouble goes to the network team, not the job owner).
        owners = rt.policy().policy.owners
        channel = owners.get(decision.owner or owner or "", owners.get("default", "#gpu-medic"))
        rt.store.update_incident(
            incident_id,
            status=IncidentStatus.REMEDIATING,
            owner=owner,
            jobs=jobs,
            classification=decision.classification.value,
            flow_run_id=str(flow_run.id) if flow_run.id else None,
            flow_run_name=flow_run.name,
        )
        log.done(
            f"{len(incident.events)} events on {incident.subject}; first answer {decision.action.value} "
            f"({decision.rule})",
            kinds=sorted({e.kind.value for e in incident.events}),
            jobs=jobs,
            owner=owner,
        )
        return Triage(
            incident=incident_id,
            node=incident.node,
            nodes=incident.nodes,
            scope=incident.scope,
            subject=incident.subject,
            gpu=gpu,
            jobs=jobs,
            owner=owner,
            channel=channel,
            fleet_size=len(scheduler.nodes()),
            decision=decision,
        )
