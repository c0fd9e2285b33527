"""The JSON form of one triage decision, `TriageLine`: a public contract (docs/triage.md); tests pin it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from medic.triage.stream import Replayed


class TriageLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    incident: str
    nodes: list[str]
    classification: Literal["hardware", "software", "infrastructure", "unknown"]
    action: Literal["none", "diagnose", "reset_gpu", "reboot", "replace", "drain", "reintegrate", "escalate"]
    diagnose_level: int | None
    rule: str
    reason: str
    # Added within schema version 1 (docs/triage.md): the node's group and mode, and why no group
    # could be told (the incident is then escalated, its mode observe).
    group: str | None = None
    mode: Literal["observe", "contain", "remediate"] = "remediate"
    group_problem: str | None = None


def triage_line(replayed: Replayed) -> TriageLine:
    decision = replayed.decision
    return TriageLine(
        incident=replayed.incident.id,
        nodes=replayed.incident.nodes,
        classification=decision.classification.value,
        action=decision.action.value,
        diagnose_level=decision.diagnose_level,
        rule=decision.rule,
        reason=decision.reason,
        group=decision.group,
        mode=decision.mode.value,
        group_problem=replayed.placement.problem,
    )
