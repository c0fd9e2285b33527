"""What people did to nodes, from Slurm's own record: each poll of the node listing is compared with the
last, and every node newly drained, failed, down, not responding, resumed, asked to reboot or rebooted
becomes one `node_state` event (docs/decisions/0019-human-actions-as-events.md).

Slurm keeps, beside a node's reason, who set it and when (`reason_set_by_user`, `reason_changed_at`), and
the node's BootTime; those are the event's user and time, and its id is built from them, so every replica
polling the same cluster derives the same id for the same change and the store keeps it once. A change
Slurm stamps with no time of its own (a resume clears the reason and its time) is keyed on the hold it
ended, or on the node's BootTime.

The first poll is the baseline: it says nothing, so a restart floods nothing. A node missing from a
listing is forgotten, not reported, and one that comes back is a new baseline. A record that cannot be
read keeps the node's last view until one can. Changes of GPU Medic's own are never reported: a reason
it set now (`medic:`), or one of its node actions that `ours` recognises.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from medic.events import FaultEvent, NodeStateChange, event_time
from medic.integrations.slurm.cli import SlurmCli
from medic.integrations.slurm.errors import UnreadableSlurmDataError
from medic.integrations.slurm.provider import BOOT_SLACK_S
from medic.integrations.slurm.records import SlurmNode, epoch, generation, is_ours

log = logging.getLogger("medic.slurm.watch")
SOURCE = "slurm"
_HELD_FLAGS = frozenset({"DRAIN", "FAIL"})
_DOWN_BASES = frozenset({"down", "error"})
_REBOOT_FLAGS = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED"})


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as one poll saw it: its state and reason, who set the reason and when, its BootTime."""

    node: SlurmNode
    reason_by: str | None
    reason_at: datetime | None
    booted_at: datetime | None

    @property
    def held(self) -> bool:
        return bool(self.node.flags & _HELD_FLAGS) or self.node.base in _DOWN_BASES

    @classmethod
    def of(cls, raw: dict[str, Any], gen: int) -> NodeView:
        node = SlurmNode.from_json(raw, gen)
        by = raw.get("reason_set_by_user")
        return cls(
            node,
            by if isinstance(by, str) and by else None,
            _time(raw, "reason_changed_at", node.name),
            _time(raw, "boot_time", node.name),
        )


def _time(raw: dict[str, Any], key: str, name: str) -> datetime | None:
    """One of Slurm's epoch times; None where it is unset, or absent (the record was trimmed)."""
    try:
        seconds = epoch(raw.get(key) or 0)
    except ValueError as error:
        raise UnreadableSlurmDataError(f"node {name}", key, str(error)) from None
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


@dataclass(frozen=True, slots=True)
class Change:
    """One node's state change between two polls, seen at `seen_at` (the previous poll at `since`)."""

    change: NodeStateChange
    before: NodeView
    after: NodeView
    since: datetime
    seen_at: datetime

    @property
    def node(self) -> str:
        return self.after.node.name

    @property
    def about(self) -> NodeView:
        """The view whose reason the change concerns: for a resume, the hold it ended."""
        return self.before if self.change == "resume" else self.after

    @property
    def reason_is_new(self) -> bool:
        """Slurm's reason was set with this change: its text or time differ from the poll before."""
        before, after = self.before, self.after
        return (after.node.reason, after.reason_at) != (before.node.reason, before.reason_at)

    @property
    def stamped_at(self) -> datetime | None:
        """The time Slurm itself keeps for the change, if it keeps one. A reason older than the change
        (a drained node going down keeps the drain's) dates the reason, not the change."""
        if self.change == "reboot":
            return self.after.booted_at
        if self.change == "resume" or not self.reason_is_new:
            return None  # a resume clears the reason and its time
        return self.after.reason_at

    @property
    def key(self) -> datetime | None:
        """What tells this change from the node's other changes of its kind, the same in every replica:
        Slurm's time for it, else the hold a resume ended, else the boot a not-responding spell is in."""
        if self.change == "resume":
            return self.before.reason_at or self.before.booted_at
        return self.stamped_at or self.after.booted_at

    @property
    def set_by_medic(self) -> bool:
        """The reason was set in this change, and by GPU Medic (`medic:`): never a person's doing."""
        return (
            self.change not in ("resume", "reboot") and self.reason_is_new and is_ours(self.after.node.reason)
        )

    def event(self) -> FaultEvent:
        about = self.about
        attributes: dict[str, Any] = {
            "change": self.change,
            "state": self.after.node.describe,
            "previous": self.before.node.describe,
            "reason": about.node.reason,
            "reason_set_by": about.reason_by,
            "reason_set_at": about.reason_at and event_time(about.reason_at),
            "seen_at": event_time(self.seen_at),
        }
        return FaultEvent(
            id=self._id(),
            time=self.stamped_at or self.seen_at,
            source=SOURCE,
            kind="node_state",
            node=self.node,
            attributes={k: v for k, v in attributes.items() if v is not None},
        )

    def _id(self) -> str:
        # Without any time of Slurm's, the minute it was seen: replicas whose polls straddle a minute
        # may then store it twice (docs/decisions/0019).
        key = self.key or self.seen_at.replace(second=0, microsecond=0)
        made = f"slurm-{self.node}-{self.change}-{int(key.timestamp())}"
        return made if len(made) <= 200 else f"slurm-{hashlib.sha256(made.encode()).hexdigest()[:40]}"


def changes(before: NodeView, after: NodeView, since: datetime, seen_at: datetime) -> list[Change]:
    """Every change from `before` to `after` of the same node, in the order Slurm makes them."""
    was, now = before.node, after.node
    resumed = before.held and not after.held
    found: list[NodeStateChange] = []
    if "DRAIN" in now.flags - was.flags:
        found.append("drain")
    if "FAIL" in now.flags - was.flags:
        found.append("fail")
    if now.base in _DOWN_BASES and was.base not in _DOWN_BASES:
        found.append("down")
    # Slurm marks a node it resumes not responding until the node answers its next ping (measured on
    # 22.05): part of the resume, not a fault of its own.
    if "NOT_RESPONDING" in now.flags - was.flags and not resumed:
        found.append("not_responding")
    if now.flags & _REBOOT_FLAGS and not was.flags & _REBOOT_FLAGS:
        found.append("reboot_requested")
    slack = timedelta(seconds=BOOT_SLACK_S)
    if before.booted_at and after.booted_at and after.booted_at > before.booted_at + slack:
        found.append("reboot")
    if resumed:
        found.append("resume")
    return [Change(change, before, after, since, seen_at) for change in found]


# Whether a change was GPU Medic's own doing, beyond a reason it set: one of its node actions.
Ours = Callable[[Change], bool]


class NodeWatch:
    """Polls Slurm's node listing and returns the changes since the last poll as events, ours left out."""

    def __init__(self, cli: SlurmCli, ours: Ours, clock: Callable[[], datetime] | None = None) -> None:
        self.cli = cli
        self.ours = ours
        self.clock = clock or (lambda: datetime.now(UTC))
        self._views: dict[str, NodeView] | None = None  # None until the baseline
        self._at: datetime | None = None
        self._unreadable: dict[str, str] = {}  # node → why its record cannot be read, said once

    def poll(self) -> list[FaultEvent]:
        """One read of the listing (one command); the events of what changed since the last read."""
        seen_at = self.clock()
        return self.take(self.cli.node_document(), seen_at)

    def take(self, doc: dict[str, Any], seen_at: datetime) -> list[FaultEvent]:
        """The events of `doc`, a node listing read at `seen_at`, against the last one taken."""
        gen = generation(doc, "node list")
        records = doc.get("nodes")
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise UnreadableSlurmDataError("node list", "nodes", "is not a list of records")
        last = self._views or {}
        views: dict[str, NodeView] = {}
        for raw in records:
            name = str(raw.get("name"))
            try:
                views[name] = NodeView.of(raw, gen)
                self._unreadable.pop(name, None)
            except UnreadableSlurmDataError as error:
                # One odd record must not blind the watch to every other node: it keeps its last view.
                if self._unreadable.get(name) != str(error):
                    log.warning("not comparing Slurm's record of %s until it can be read: %s", name, error)
                    self._unreadable[name] = str(error)
                if name in last:
                    views[name] = last[name]
        found: list[Change] = []
        if self._views is not None and self._at is not None:
            for name, view in views.items():
                if name in last:
                    found.extend(changes(last[name], view, self._at, seen_at))
        self._views, self._at = views, seen_at
        return [change.event() for change in found if not (change.set_by_medic or self.ours(change))]
