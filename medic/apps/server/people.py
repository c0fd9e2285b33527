"""What people did to nodes, stored as events: `medic serve` polls the scheduler's record of its nodes
(a `NodeChangeWatch`: Slurm's node listing, medic/integrations/slurm/watch.py) and stores each change GPU Medic
did not make as a `node_state` event (docs/decisions/0019-human-actions-as-events.md).

They are stored only: no incident, no flow run, no action. A change GPU Medic made is left out: a reason
it set (medic/integrations/slurm/watch.py), or one of its node actions under way on that node between the two
polls that saw the change (the actions table; the intent is written before Slurm is asked, so a replica
polling at any moment finds it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

import anyio

from medic.protocols import NodeChangeWatch
from medic.store import Store

if TYPE_CHECKING:
    from medic.integrations.slurm.watch import Change, Ours

log = logging.getLogger("medic.people")

INTERVAL_ENV = "MEDIC_SLURM_WATCH_SECONDS"
DEFAULT_INTERVAL_S = 30.0
# How far before the poll that first saw a change an action of ours may have finished and still be its
# cause: Slurm's record lags a command by a moment, and replicas' clocks differ by a little.
GRACE = timedelta(minutes=5)

_REPAIRS = ("reboot", "reset_gpu", "replace")
# Which of our actions can make each change. Our drains carry `medic:`, so a drain with any other reason
# is never ours; a reboot takes the node down and not responding, and HyperPod's convention fails it
# (`Action:Reboot`); our resume, a reboot with nextstate=RESUME, or HyperPod's agent return it.
CAUSES: Mapping[str, tuple[str, ...]] = {
    "drain": (),
    "fail": _REPAIRS,
    "down": _REPAIRS,
    "not_responding": _REPAIRS,
    "reboot_requested": _REPAIRS,
    "reboot": _REPAIRS,
    "resume": ("resume", *_REPAIRS),
}


def interval_s(env: Mapping[str, str]) -> float:
    """MEDIC_SLURM_WATCH_SECONDS: seconds between polls, 5 to 3600; 0 turns the watch off."""
    raw = env.get(INTERVAL_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV}={raw!r} is not a number of seconds") from None
    if value != 0 and not 5 <= value <= 3600:
        raise ValueError(f"{INTERVAL_ENV}={raw!r}: give 5 to 3600 seconds, or 0 for no watch")
    return value


def ours_in(store: Store) -> Ours:
    """Whether one of our node actions that can make the change was under way while it happened."""

    def ours(change: Change) -> bool:
        causes = CAUSES[change.change]
        if not causes:
            return False
        found = store.actions_during(change.node, change.since - GRACE, change.seen_at, causes)
        if found:
            log.debug("%s %s on %s is ours: %s", change.change, change.node, change.seen_at, found[0].key)
        return bool(found)

    return ours


class PeopleWatch:
    """One watch whose events go to the store, once each whichever replica saw them first."""

    def __init__(self, store: Store, watch: NodeChangeWatch) -> None:
        self.store = store
        self.watch = watch

    def poll(self) -> int:
        """One poll; how many events were stored (another replica may have stored some first)."""
        stored = self.store.record_accepted(self.watch.poll())
        for event in stored:
            attributes = event.attributes
            log.info(
                "%s: %s, reason %r set by %s, as Slurm records it",
                event.node,
                attributes["change"],
                attributes.get("reason", ""),
                attributes.get("reason_set_by", "no one"),
            )
        return len(stored)

    async def forever(self, every_s: float) -> None:
        """Poll every `every_s` seconds until cancelled; a poll that fails is logged and the next one
        compares with the last listing read."""
        while True:
            try:
                await anyio.to_thread.run_sync(self.poll, abandon_on_cancel=True)
            except Exception:  # slurmctld or the store is down: try again next time
                log.exception("reading what people did to nodes from Slurm failed")
            await asyncio.sleep(every_s)
