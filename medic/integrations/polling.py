"""Waiting for a node to come back after an action, and the ownership rule the node providers share.

`poll` waits for a cloud resource to reach a state, with an injectable clock so tests need not sleep.

`Comeback` and `wait_back` make readiness truthful: a provider records what the node looked like when it
asked for the reboot or replacement, and `wait_ready` answers True only once it has seen the node go
away and come back (a new boot time, a new instance or launch time, a status that left Running and
returned). A node that is still "running" right after the request never left: that is not ready. When
time runs out first, `NodeNotBackError` says so; it is permanent (waiting again would not prove more),
so nothing retries it and the incident escalates with the node still out of service.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from medic.errors import PermanentError
from medic.integrations.provider_errors import ActionRefusedError, ProviderError
from medic.protocols import NodeState, Scheduler

T = TypeVar("T")

OURS = "medic:"  # the reason prefix of GPU Medic's own drains (medic/tasks/nodes/service.py)


def poll(
    check: Callable[[], T | None],
    timeout_s: float,
    interval_s: float,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> T | None:
    """Call `check` until it returns something other than None, or until `timeout_s` has passed.

    `check` always runs at least once, so a zero timeout still reports the current state.
    """
    deadline = clock() + timeout_s
    while True:
        result = check()
        if result is not None:
            return result
        remaining = deadline - clock()
        if remaining <= 0:
            return None
        sleep(min(interval_s, remaining))


@dataclass(slots=True)
class Comeback:
    """One requested reboot or replacement whose outcome `wait_ready` has yet to prove."""

    node: str
    action: str  # reboot | replace
    before: str  # the marker recorded at the request, in words ("BootTime 2026-11-02 10:00:00Z")
    went_away: bool = False  # seen down, in another state, or with a new boot/instance since the request
    last_seen: str = "not looked at yet"


class NodeNotBackError(ProviderError, PermanentError):
    """Raised when `wait_ready` ran out of time before it saw the node go away and come back after
    the action: the outcome is unconfirmed, so the node stays out of service and a human decides."""

    def __init__(self, comeback: Comeback, waited_s: float) -> None:
        what = (
            "went away but was not seen back"
            if comeback.went_away
            else "was never seen to go down (it may not have rebooted at all)"
        )
        super().__init__(
            f"{comeback.node}: not confirmed back {waited_s:.0f} s after the {comeback.action}: it {what}; "
            f"before: {comeback.before}; last seen: {comeback.last_seen}"
        )
        self.node = comeback.node
        self.action = comeback.action
        self.before = comeback.before
        self.last_seen = comeback.last_seen
        self.went_away = comeback.went_away
        self.waited_s = waited_s


def wait_back(
    comeback: Comeback,
    check: Callable[[Comeback], bool | None],
    timeout_s: float,
    interval_s: float,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> bool:
    """Poll `check` (True: proven back; False: gone for good; None: not yet, having updated
    `comeback.went_away` and `last_seen`) until it decides; raise NodeNotBackError at the timeout."""
    started = clock()
    result = poll(lambda: check(comeback), timeout_s, interval_s, sleep, clock)
    if result is None:
        raise NodeNotBackError(comeback, clock() - started)
    return result


class NodeHeldError(ActionRefusedError):
    """Raised before a reboot or replacement when someone else holds the node: an admin's drain, another
    tool's tag, an Auto Scaling Standby, an operation already under way. No request is sent."""

    def __init__(self, node: str, holder: str, action: str) -> None:
        super().__init__(f"{node} is held by {holder}; GPU Medic does not {action} it")
        self.node = node
        self.holder = holder
        self.action = action


def scheduler_holder(scheduler: Scheduler | None, node: str) -> str | None:
    """Who holds `node` out of service in the scheduler, if not GPU Medic: None when it is free or ours.

    Drained, down or rebooting with a reason that does not start with "medic:" is someone else's."""
    if scheduler is None:
        return None
    info = scheduler.node(node)
    if info.state not in (NodeState.DRAINED, NodeState.DOWN, NodeState.REBOOTING):
        return None
    if (info.reason or "").startswith(OURS):
        return None
    return f"the scheduler ({info.state.value}, reason: {info.reason or 'none given'})"
