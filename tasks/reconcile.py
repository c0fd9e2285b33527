"""Settling actions whose outcome was lost in a crash, by asking the backend, not guessing."""

from __future__ import annotations

from collections.abc import Collection

from medic.protocols import BootClock
from medic.statuses import ActionStatus
from tasks.runtime import Runtime

REBOOTING = frozenset({"reboot", "replace"})


def reconcile_intents(rt: Runtime, incidents: Collection[str] | None = None) -> list[str]:
    """Each unfinished reboot/replace (of these incidents, or of all at start) becomes succeeded or
    failed when the provider knows the node's boot time; anything else stays an intent, and the
    act stage escalates it instead of repeating a destructive action blind.

    Only for incidents no live run holds: a run between its intent and its outcome is not lost."""
    provider = rt.backends.provider
    settled = []
    for action in rt.store.unfinished_actions():
        if action.action not in REBOOTING or not isinstance(provider, BootClock):
            continue
        if incidents is not None and action.incident_id not in incidents:
            continue
        booted = provider.booted_at(action.node)
        if booted is None:
            continue
        if booted >= action.intent_at:
            rt.store.finish_action(
                action.key, ActionStatus.SUCCEEDED, f"reconciled: {action.node} booted at {booted:%H:%M:%S}"
            )
            settled.append(f"{action.key}: done (booted after the intent)")
        else:
            rt.store.finish_action(
                action.key, ActionStatus.FAILED, "reconciled: the node has not booted since the intent"
            )
            settled.append(f"{action.key}: not done (may be retried)")
    return settled
