"""Settling actions whose outcome was lost in a crash, by asking the backend, not guessing."""

from __future__ import annotations

import logging
from collections.abc import Collection

from medic.policy.model import DESTRUCTIVE
from medic.protocols import Reconcilable
from medic.statuses import ActionStatus
from medic.tasks.runtime.process import Runtime

log = logging.getLogger(__name__)

SETTLEABLE = frozenset(a.value for a in DESTRUCTIVE)


def reconcile_intents(rt: Runtime, incidents: Collection[str] | None = None) -> list[str]:
    """Each unfinished reboot, reset or replacement (of these incidents, or of all at start) becomes
    succeeded or failed when the provider's own record tells (Slurm's BootTime and reboot flags, EC2's
    instance state, launch time and Auto Scaling health, HyperPod's node status and launch time, or
    the scheduler's boot record for a cloud reboot); anything else stays an intent, and the act stage
    escalates it instead of repeating a destructive action blind.

    Only for incidents no live run holds: a run between its intent and its outcome is not lost."""
    provider = rt.backends.provider
    if not isinstance(provider, Reconcilable):
        return []
    settled = []
    for action in rt.store.unfinished_actions():
        if action.action not in SETTLEABLE:
            continue
        if incidents is not None and action.incident_id not in incidents:
            continue
        try:
            answer = provider.settle(action.node, action.action, action.intent_at)
        except Exception as error:  # one backend failing to answer leaves that intent, not the others
            log.warning("could not settle %s: %s: %s", action.key, type(error).__name__, error)
            continue
        if answer is not None and not answer.done and action.action == "reset_gpu" and rt.backends.gpu_reset:
            # A reset in place leaves no boot behind: no boot proves only that no fallback reboot
            # happened, not that the reset did not.
            answer = None
        if answer is None:
            continue
        if answer.done:
            rt.store.finish_action(action.key, ActionStatus.SUCCEEDED, f"reconciled: {answer.detail}")
            settled.append(f"{action.key}: done ({answer.detail})")
        else:
            rt.store.finish_action(action.key, ActionStatus.FAILED, f"reconciled: {answer.detail}")
            settled.append(f"{action.key}: not done ({answer.detail})")
    return settled
