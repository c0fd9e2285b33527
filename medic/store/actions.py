"""Node actions: the intent is written before the call, the outcome after.

An intent without an outcome means a process died between the call and its record, and
reconciliation settles it. The statuses are `medic.statuses.ActionStatus`.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import or_, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from medic.statuses import ActionStatus
from medic.store.engine import StoreBase, utcnow
from medic.store.ledger import audited
from medic.store.tables import ActionRecord


class ActionsMixin(StoreBase):
    def claim_action(self, key: str, incident_id: str, node: str, action: str) -> tuple[ActionRecord, bool]:
        """Write the intent. Returns (row, True) for a new claim, or for a failed one taken back
        to try again; (existing row, False) otherwise.

        The unique key makes this safe across processes: two flow runs racing for the same
        fault get one claim between them.
        """
        with self.session() as s:
            existing = s.exec(select(ActionRecord).where(ActionRecord.key == key)).first()
            if existing is not None:
                if existing.status != ActionStatus.FAILED:
                    return existing, False
                # The call raised: it is tried again, and taking the claim back is one
                # conditional update, so two retrying runs still get one claim between them.
                retake = (
                    update(ActionRecord)
                    .where(col(ActionRecord.key) == key)
                    .where(col(ActionRecord.status) == ActionStatus.FAILED)
                    .values(status=ActionStatus.INTENT, intent_at=utcnow())
                )
                taken = len(audited(s, retake)) == 1
                s.commit()
                s.expire_all()
                return s.exec(select(ActionRecord).where(ActionRecord.key == key)).one(), taken
            row = ActionRecord(
                key=key,
                incident_id=incident_id,
                node=node,
                action=action,
                status=ActionStatus.INTENT,
                intent_at=utcnow(),
            )
            s.add(row)
            try:
                s.commit()
            except IntegrityError:
                s.rollback()
                return s.exec(select(ActionRecord).where(ActionRecord.key == key)).one(), False
            return row, True

    def covering_action(
        self, node: str, fault_until: datetime, actions: Iterable[str], other_than: str
    ) -> ActionRecord | None:
        """Our action of these kinds on the node, for an incident other than `other_than`, that came
        after a fault's evidence ended at `fault_until`: it finished then or later, or has no outcome.

        A destructive action is claimed per node and fault episode, not only per incident: the
        evidence of a fault that a reboot already followed is that reboot's, whichever incident
        (replica, restart, late duplicate) it arrives in. Evidence after it is a new episode.
        """
        query = (
            select(ActionRecord)
            .where(ActionRecord.node == node)
            .where(ActionRecord.incident_id != other_than)
            .where(col(ActionRecord.action).in_(list(actions)))
            .where(col(ActionRecord.status).in_([ActionStatus.INTENT, ActionStatus.SUCCEEDED]))
            .where(or_(col(ActionRecord.finished_at).is_(None), col(ActionRecord.finished_at) >= fault_until))
            .order_by(col(ActionRecord.intent_at).desc())
        )
        with self.session() as s:
            return s.exec(query).first()

    def unfinished_actions(self) -> list[ActionRecord]:
        """Intents without an outcome: a process died between the call and its record."""
        with self.session() as s:
            return list(s.exec(select(ActionRecord).where(ActionRecord.status == ActionStatus.INTENT)))

    def get_action(self, key: str) -> ActionRecord | None:
        with self.session() as s:
            return s.exec(select(ActionRecord).where(ActionRecord.key == key)).first()

    def finish_action(self, key: str, status: str, detail: str = "", attempts: int = 1) -> ActionRecord:
        with self.session() as s:
            row = s.exec(select(ActionRecord).where(ActionRecord.key == key)).one()
            row.status = status
            row.detail = detail
            row.attempts += attempts
            row.finished_at = utcnow()
            s.add(row)
            s.commit()
            return row

    def actions_since(self, since: datetime, actions: Iterable[str]) -> list[ActionRecord]:
        """Our successful actions of these kinds on any node since a time, oldest first."""
        with self.session() as s:
            return succeeded_actions(s, since, actions=actions)

    def node_actions(self, node: str, since: datetime) -> list[ActionRecord]:
        """Our successful actions on a node since a time: its remediation history."""
        with self.session() as s:
            return succeeded_actions(s, since, node=node)


def succeeded_actions(
    s: Session, since: datetime, *, node: str | None = None, actions: Iterable[str] | None = None
) -> list[ActionRecord]:
    """Our successful actions since a time (on one node, of these kinds), oldest first."""
    query = (
        select(ActionRecord)
        .where(ActionRecord.status == ActionStatus.SUCCEEDED)
        .where(col(ActionRecord.intent_at) >= since)
    )
    if node is not None:
        query = query.where(ActionRecord.node == node)
    if actions is not None:
        query = query.where(col(ActionRecord.action).in_(list(actions)))
    return list(s.exec(query.order_by(col(ActionRecord.intent_at))))
