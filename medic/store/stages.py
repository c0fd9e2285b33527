"""What each stage of a flow run did: its step, the diagnostics it ran, the decisions it made.

Write-once rows: a stage adds them as it ends and nothing changes them afterwards.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from medic.policy.model import Decision
from medic.store.engine import StoreBase, utcnow
from medic.store.tables import DecisionRecord, DiagnosticRecord, StepRecord


class StagesMixin(StoreBase):
    def add_step(
        self,
        incident_id: str,
        stage: str,
        started_at: datetime,
        status: str,
        summary: str,
        detail: dict[str, Any] | None = None,
    ) -> StepRecord:
        row = StepRecord(
            incident_id=incident_id,
            stage=stage,
            started_at=started_at,
            finished_at=utcnow(),
            status=status,
            summary=summary,
            detail=detail,
        )
        with self.session() as s:
            s.add(row)
            s.commit()
        return row

    def add_diagnostic(self, row: DiagnosticRecord) -> DiagnosticRecord:
        with self.session() as s:
            s.add(row)
            s.commit()
        return row

    def add_decision(
        self, decision: Decision, policy_path: str, facts: dict[str, Any] | None = None
    ) -> DecisionRecord:
        """Record a decision with the facts it was made on (medic.policy.replay.record_facts)."""
        row = DecisionRecord(
            incident_id=decision.incident,
            decided_at=utcnow(),
            policy_path=policy_path,
            policy_sha256=decision.policy_sha256,
            rule=decision.rule,
            classification=decision.classification.value,
            action=decision.action.value,
            diagnose_level=decision.diagnose_level,
            reason=decision.reason,
            matched=decision.matched,
            recommend=decision.recommend,
            guardrail=decision.guardrail,
            blocked_action=decision.blocked_action.value if decision.blocked_action else None,
            facts=facts,
        )
        with self.session() as s:
            s.add(row)
            s.commit()
        return row
