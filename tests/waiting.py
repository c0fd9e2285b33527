"""Waiting in tests for something another thread or process does: poll until true, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def until(check: Callable[[], Any], what: str, timeout_s: float = 90) -> Any:
    """`check()`'s first truthy result, polled every 0.2 s; AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return result
