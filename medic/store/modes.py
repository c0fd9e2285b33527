"""The modes node groups run in, as each policy file that changed them set them (decision 0017).

A row is written only where a newly read policy differs from the last row for the group: the ledger
then shows every switch from observe to contain to remediate (and back), who owned the file, when.
A store with no row has run every node in `remediate`, as GPU Medic did before groups existed.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy.exc import IntegrityError
from sqlmodel import col, select

from medic.policy.selectors import OTHER_NODES
from medic.store.engine import StoreBase, utcnow
from medic.store.tables import ModeChangeRecord

BEFORE_GROUPS = {OTHER_NODES: "remediate"}


class ModesMixin(StoreBase):
    def last_modes(self) -> dict[str, str | None]:
        """Each group's mode as last recorded (None: removed); `*` for the nodes no group takes."""
        modes: dict[str, str | None] = dict(BEFORE_GROUPS)
        with self.session() as s:
            for row in s.exec(select(ModeChangeRecord).order_by(col(ModeChangeRecord.id))):
                modes[row.node_group] = row.mode
        return modes

    def record_modes(
        self, modes: Mapping[str, str], *, by: str, policy_path: str, policy_sha256: str
    ) -> list[ModeChangeRecord]:
        """Record every group whose mode differs from its last record (a group gone: mode None).
        Another replica recording the same policy first is no error: its rows stand."""
        last = self.last_modes()
        wanted: dict[str, str | None] = {group: None for group, mode in last.items() if mode is not None}
        wanted.update(modes)
        now = utcnow()
        rows = [
            ModeChangeRecord(
                changed_at=now,
                node_group=group,
                mode=mode,
                previous=last.get(group),
                by=by,
                policy_path=policy_path,
                policy_sha256=policy_sha256,
            )
            for group, mode in sorted(wanted.items())
            if last.get(group) != mode
        ]
        if not rows:
            return []
        with self.session() as s:
            s.add_all(rows)
            try:
                s.commit()
            except IntegrityError:
                s.rollback()
                return []
        return rows

    def mode_changes(self) -> list[ModeChangeRecord]:
        with self.session() as s:
            return list(s.exec(select(ModeChangeRecord).order_by(col(ModeChangeRecord.id))))
