"""Whether a command may split its work over a second, forked process."""

from __future__ import annotations

import multiprocessing
import os


def cores() -> int:
    """The cores this process may run on (what `nproc` prints)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def can_fork() -> bool:
    # The second process starts as a copy of this one: with the policy loaded and everything imported,
    # not with a fresh interpreter importing it all again.
    return "fork" in multiprocessing.get_all_start_methods()
