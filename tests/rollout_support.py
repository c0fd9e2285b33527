"""One rollout written through the store's own methods, for the tests of `medic rollout report` and of
its gauges on /metrics: a canary group observing beside the remediated rest, and people on Slurm."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from factories import fault_event

from medic.incidents import correlate
from medic.policy.model import Action, Classification, Decision
from medic.policy.selectors import Mode
from medic.store import Store

# The canary group by name, with its own bar; the policy's bar for the rest.
CANARY_POLICY = """\
readiness: {min_decisions: 10, min_agreement: 0.5}
groups:
  - name: canary
    select: {hostlist: ["gpu-00[1-9]"]}
    mode: observe
    readiness: {min_decisions: 3, max_destructive_disagreements: 1}
rules: []
"""


def decide(
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
    node: str,
    action: Action,
    mode: Mode,
    group: str | None,
    at: datetime,
) -> None:
    (incident,) = correlate([fault_event(node=node, at=at, minutes=-1)])
    store.record_events([incident])
    store.open_incident(incident)
    with monkeypatch.context() as clock:
        clock.setattr("medic.store.stages.utcnow", lambda: at)
        store.add_decision(
            Decision(
                incident=incident.id,
                classification=Classification.HARDWARE,
                action=action,
                rule="xid-fallen-off-bus",
                reason="XID 79",
                matched=["xid-fallen-off-bus"],
                policy_sha256="0" * 64,
                mode=mode,
                group=group,
            ),
            "policies/default.yaml",
        )


def people(store: Store, node: str, change: str, at: datetime) -> None:
    store.record_accepted(
        [
            fault_event(
                "node_state",
                id=f"slurm-{node}-{change}-{int(at.timestamp())}",
                source="slurm",
                node=node,
                at=at,
                change=change,
            )
        ]
    )


def seed(store: Store, monkeypatch: pytest.MonkeyPatch, day0: datetime) -> None:
    """canary, observing: an agreed reboot (people 90 min later), a drain people answered with a reboot,
    a replace people never did on a node that did not fail again, and a drain by people on a node
    GPU Medic never decided on (gpu-009); the other nodes remediated: acted on, never a would-have."""
    store.record_modes(
        {"*": "remediate", "canary": "observe"}, by="sre", policy_path="p.yaml", policy_sha256="0" * 64
    )
    hour = timedelta(hours=1)
    decide(store, monkeypatch, "gpu-001", Action.REBOOT, Mode.OBSERVE, "canary", day0)
    people(store, "gpu-001", "reboot_requested", day0 + 1.5 * hour)
    decide(store, monkeypatch, "gpu-002", Action.DRAIN, Mode.OBSERVE, "canary", day0 + hour)
    people(store, "gpu-002", "reboot", day0 + 2 * hour)
    decide(store, monkeypatch, "gpu-003", Action.REPLACE, Mode.OBSERVE, "canary", day0 + 2 * hour)
    people(store, "gpu-009", "drain", day0 + 3 * hour)
    decide(store, monkeypatch, "gpu-100", Action.REBOOT, Mode.REMEDIATE, None, day0 + 4 * hour)
