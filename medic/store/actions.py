"""Node actions: the intent is written before the call, the outcome after.

An intent without an outcome means a process died between the call and its record, and
reconciliation settles it. The statuses are `medic.statuses.ActionStatus`.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import and_, func, or_, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from medic.holds import Hold
from medic.statuses import ActionStatus
from medic.store.engine import StoreBase, utcnow
from medic.store.ledger import audited
from medic.store.tables import ActionRecord, IncidentRecord

# The actions that leave a node out of service until we resume it (a reboot or a replacement does not
# return the node by itself: it comes back after its verification), and the one that returns it.
TAKE_OUT = ("drain", "reset_gpu", "reboot", "replace")
RETURN = "resume"


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

    def held_nodes(self, node: str | None = None) -> list[Hold]:
        """Every node (or this one) whose last successful action of ours took it out of service and
        that no `resume` of ours followed: the nodes GPU Medic holds, oldest hold first.

        The store's side only: a human who returned a node in the scheduler by hand is not seen
        here (`medic node held` asks the scheduler too)."""
        with self.session() as s:
            return held_nodes(s, node)

    def actions_since(self, since: datetime, actions: Iterable[str]) -> list[ActionRecord]:
        """Our successful actions of these kinds on any node since a time, oldest first."""
        with self.session() as s:
            return succeeded_actions(s, since, actions=actions)

    def taken_out_since(self, since: datetime) -> set[str]:
        """The nodes we meant to take out of service since a time, whatever came of it (an intent
        whose outcome was never recorded may have happened), less those we returned after."""
        query = (
            select(ActionRecord.node, ActionRecord.action, ActionRecord.status)
            .where(col(ActionRecord.intent_at) >= since)
            .where(col(ActionRecord.action).in_([*TAKE_OUT, RETURN]))
            .order_by(col(ActionRecord.intent_at))
        )
        out: set[str] = set()
        with self.session() as s:
            for node, action, status in s.exec(query):
                if action != RETURN:
                    out.add(node)
                elif status == ActionStatus.SUCCEEDED:
                    out.discard(node)
        return out

    def actions_during(
        self, node: str, start: datetime, end: datetime, actions: Iterable[str]
    ) -> list[ActionRecord]:
        """Our actions of these kinds on the node, whatever their outcome, under way at some time from
        `start` to `end`: asked for by `end`, not finished before `start` (or never finished)."""
        query = (
            select(ActionRecord)
            .where(ActionRecord.node == node)
            .where(col(ActionRecord.action).in_(list(actions)))
            .where(col(ActionRecord.intent_at) <= end)
            .where(or_(col(ActionRecord.finished_at).is_(None), col(ActionRecord.finished_at) >= start))
        )
        with self.session() as s:
            return list(s.exec(query))

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


def held_nodes(s: Session, node: str | None = None) -> list[Hold]:
    """`ActionsMixin.held_nodes` in an open session."""
    moves = [*TAKE_OUT, RETURN]
    done = and_(col(ActionRecord.status) == ActionStatus.SUCCEEDED, col(ActionRecord.action).in_(moves))
    latest = select(ActionRecord.node, func.max(ActionRecord.finished_at).label("at")).where(done)
    if node is not None:
        latest = latest.where(ActionRecord.node == node)
    last = latest.group_by(col(ActionRecord.node)).subquery()
    query = (
        select(ActionRecord, IncidentRecord)
        .join(last, and_(col(ActionRecord.node) == last.c.node, col(ActionRecord.finished_at) == last.c.at))
        .join(IncidentRecord, col(IncidentRecord.id) == col(ActionRecord.incident_id), isouter=True)
        .where(done)
        .order_by(col(ActionRecord.finished_at))
    )
    rows = s.exec(query).all()
    held: dict[str, Hold] = {}
    returned: set[str] = set()
    for action, incident in rows:
        if action.action == RETURN:  # one finished in the same instant as a take-out wins: returned
            returned.add(action.node)
            continue
        assert action.finished_at is not None  # succeeded rows always have it
        held.setdefault(
            action.node,
            Hold(
                node=action.node,
                incident=action.incident_id,
                action=action.action,
                since=action.finished_at,
                incident_status=incident.status if incident is not None else None,
                outcome=incident.outcome if incident is not None else None,
            ),
        )
    return [h for n, h in held.items() if n not in returned]
