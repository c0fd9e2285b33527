"""`medic triage`: events in, one decision per incident out, nothing acted on. No Prefect needed.

The JSON form of `TriageLine` is a public contract (docs/triage.md); tests pin it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict

from medic.events import FaultEvent
from medic.facts import facts_of
from medic.incidents import Incident, correlate
from medic.policy import LoadedPolicy, decide
from medic.policy.model import Decision


class TriageLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    incident: str
    nodes: list[str]
    classification: Literal["hardware", "software", "infrastructure", "unknown"]
    action: Literal["none", "diagnose", "reset_gpu", "reboot", "replace", "drain", "reintegrate", "escalate"]
    diagnose_level: int | None
    rule: str
    reason: str


def triage_line(incident: Incident, decision: Decision) -> TriageLine:
    return TriageLine(
        incident=incident.id,
        nodes=incident.nodes,
        classification=decision.classification.value,
        action=decision.action.value,
        diagnose_level=decision.diagnose_level,
        rule=decision.rule,
        reason=decision.reason,
    )


def triage(events: Iterable[FaultEvent], loaded: LoadedPolicy) -> Iterator[tuple[Incident, Decision]]:
    window = timedelta(minutes=loaded.policy.defaults.incident_window_minutes)
    for incident in correlate(events, window):
        yield incident, decide(loaded.policy, facts_of(incident), loaded.sha256)
