"""GPU Medic's own events in Prefect's event feed, so Prefect automations can react to them.

`medic.fault.received`, `medic.incident.opened`, `medic.incident.closed` and
`medic.action.<type>`, each about a `medic.incident.<id>` resource with the node (and jobs) as
related resources. Sent through Prefect's background event worker: never blocking, never raising.

An incident's announcement (`medic.incident.opened` and its `medic.fault.received`) is sent
wherever the incident is opened, the same whichever process then runs it, and never from the
flow run: with `medic serve --dispatch prefect` it is what starts the run (the deployment's trigger).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from prefect.events import emit_event

from medic.events import FaultEvent
from medic.incidents import Incident

log = logging.getLogger("medic.prefect_events")


def _related(nodes: Iterable[str], jobs: Iterable[str]) -> list[dict[str, str]]:
    related = [
        {"prefect.resource.id": f"medic.node.{node}", "prefect.resource.role": "node"} for node in nodes
    ]
    related += [{"prefect.resource.id": f"medic.job.{job}", "prefect.resource.role": "job"} for job in jobs]
    return related


def _emit(
    name: str,
    incident: str,
    node: str,
    jobs: Iterable[str],
    payload: dict[str, Any],
    at: datetime | None,
    nodes: Iterable[str] = (),
    key: str | None = None,
) -> None:
    # The incident id and node as labels: a deployment trigger passes them on as parameters.
    resource = {
        "prefect.resource.id": f"medic.incident.{incident}",
        "medic.incident": incident,
        "medic.node": node,
    }
    try:
        emit_event(
            event=name,
            resource=resource,
            related=_related(nodes or [node], jobs),
            payload=payload,
            occurred=at,
            id=event_id(name, key) if key else None,
        )
    except Exception:  # the store is the record (unannounced, a --dispatch prefect incident stays open)
        log.warning("could not emit %s for %s", name, incident, exc_info=True)


def event_id(name: str, key: str) -> uuid.UUID:
    """The fixed id of the `name` event about `key` (an incident, an incident's fault).

    Prefect stores one event per id and its triggers skip an id seen in the last 30 minutes,
    so announcing the same incident again does not start a second flow run.
    """
    return uuid.uuid5(uuid.NAMESPACE_URL, f"medic:{name}:{key}")


def incident_opened(incident: Incident) -> None:
    for event in incident.events:
        fault_received(event, incident.id)
    _emit(
        "medic.incident.opened",
        incident.id,
        incident.node,
        incident.jobs,
        {
            "scope": incident.scope,
            "events": len(incident.events),
            "kinds": sorted({e.kind.value for e in incident.events}),
        },
        incident.opened_at,
        incident.nodes,
        key=incident.id,
    )


def fault_received(event: FaultEvent, incident_id: str) -> None:
    _emit(
        "medic.fault.received",
        incident_id,
        event.node,
        [event.job] if event.job else [],
        event.model_dump(mode="json", exclude_none=True),
        event.time,
        key=f"{incident_id}:{event.id}",
    )


def incident_closed(incident_id: str, node: str, jobs: Iterable[str], status: str, outcome: str) -> None:
    _emit("medic.incident.closed", incident_id, node, jobs, {"status": status, "outcome": outcome}, None)


def action_taken(incident_id: str, node: str, action: str, status: str, detail: str) -> None:
    _emit(f"medic.action.{action}", incident_id, node, [], {"status": status, "detail": detail}, None)
