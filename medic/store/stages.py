"""What each stage of a flow run did: its step, the diagnostics it ran, the decisions it made.

Write-once rows: a stage adds them as it ends and nothing changes them afterwards.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func
from sqlmodel import col, select

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

    def steps_of(self, incident_id: str) -> list[StepRecord]:
        """The steps recorded under an id, in order: an incident's, or a sweep's (which is no incident)."""
        query = select(StepRecord).where(StepRecord.incident_id == incident_id).order_by(col(StepRecord.id))
        with self.session() as s:
            return list(s.exec(query))

    def diagnostics_of(self, incident_id: str) -> list[DiagnosticRecord]:
        query = (
            select(DiagnosticRecord)
            .where(DiagnosticRecord.incident_id == incident_id)
            .order_by(col(DiagnosticRecord.id))
        )
        with self.session() as s:
            return list(s.exec(query))

    def last_deep_checks(self, min_level: int = 2) -> dict[str, datetime]:
        """When each node last finished a DCGM run at `min_level` or above that gave a verdict (pass
        or fail), whoever ran it: a sweep, a ladder, a verification. An `error` measured nothing."""
        query = (
            select(DiagnosticRecord.node, func.max(DiagnosticRecord.finished_at))
            .where(col(DiagnosticRecord.level) >= min_level)
            .where(col(DiagnosticRecord.result).in_(["pass", "fail"]))
            .group_by(col(DiagnosticRecord.node))
        )
        with self.session() as s:
            return dict(s.exec(query).all())

    def add_decision(
        self, decision: Decision, policy_path: str, facts: dict[str, Any] | None = None
    ) -> DecisionRecord:
        """Record a decision with the facts it was made on (medic.whatif.replay.record_facts)."""
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
            mode=decision.mode.value,
            node_group=decision.group,
        )
        with self.session() as s:
            s.add(row)
            s.commit()
        return row
