"""Waiting for a cloud resource to reach a state, with an injectable clock so tests need not sleep."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


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
