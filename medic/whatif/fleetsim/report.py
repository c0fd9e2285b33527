"""What a simulated run cost: goodput, badput by cause, and what people and spares had to do.

Every second of the run is exactly one of: training kept (goodput), or one kind of badput.
`BADPUT` names the kinds in the order reports list them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BADPUT: dict[str, str] = {
    "checkpoint": "saving checkpoints",  # training blocked while a save runs
    "lost_work": "lost work",  # training since the last completed save, redone after a restart
    "detection": "detection",  # fault to event received
    "diagnosis": "diagnosis",  # the job waiting on a diagnostic run on its node (level 1)
    "recovery": "recovery",  # waiting for a node to restart on, restarting from the checkpoint
    "false_replacement": "false replacements",  # waiting for a node after replacing one not at fault
}


@dataclass(frozen=True, slots=True)
class Report:
    policy: str
    policy_sha256: str
    seed: int
    params: dict[str, Any]
    checkpoint_interval_s: float
    wall_s: float
    goodput_s: float
    badput_s: dict[str, float]  # keys: BADPUT
    interruptions: int
    faults: int  # drawn from the failure model
    repeats: int  # the same fault again, on a node it was left in
    by_cause: dict[str, int]
    actions: dict[str, int]  # the final decision of each incident
    rules: dict[str, int]  # the rule behind each final decision
    human_interventions: int  # escalations, drains and repeat offenders a person had to handle
    approvals: int
    nodes_replaced: int
    false_replacements: int
    timeline: tuple[
        tuple[float, float], ...
    ]  # (hours, goodput fraction so far) at each interruption and the end
    decided: int  # incidents the engine decided
    asked: int  # decisions the run needed

    @property
    def goodput(self) -> float:
        return self.goodput_s / self.wall_s

    @property
    def badput_fraction(self) -> dict[str, float]:
        return {k: v / self.wall_s for k, v in self.badput_s.items()}

    @property
    def dominant_badput(self) -> str:
        return max(BADPUT, key=lambda k: self.badput_s[k])

    @property
    def observed_mtbf_s(self) -> float:
        return self.wall_s / self.interruptions if self.interruptions else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form (docs/simulate.md#json): sorted counts, seconds to 0.1 s."""
        return {
            "policy": self.policy,
            "policy_sha256": self.policy_sha256,
            "seed": self.seed,
            "params": self.params,
            "checkpoint_interval_s": round(self.checkpoint_interval_s, 1),
            "wall_s": round(self.wall_s, 1),
            "goodput": round(self.goodput, 6),
            "goodput_s": round(self.goodput_s, 1),
            "badput_s": {k: round(self.badput_s[k], 1) for k in BADPUT},
            "dominant_badput": self.dominant_badput,
            "interruptions": self.interruptions,
            "faults": self.faults,
            "repeats": self.repeats,
            "observed_mtbf_s": round(self.observed_mtbf_s, 1),
            "by_cause": dict(sorted(self.by_cause.items())),
            "actions": dict(sorted(self.actions.items())),
            "rules": dict(sorted(self.rules.items())),
            "human_interventions": self.human_interventions,
            "approvals": self.approvals,
            "nodes_replaced": self.nodes_replaced,
            "false_replacements": self.false_replacements,
            "engine": {"incidents_decided": self.decided, "decisions": self.asked},
        }
