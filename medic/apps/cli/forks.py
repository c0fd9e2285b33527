"""A command's work split over a second, forked process: whether it may be, and what the forked
helper does to hand its work over (`medic triage`'s reading, `medic policy replay`'s later part)."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TypeVar

T = TypeVar("T")


def cores() -> int:
    """The cores this process may run on (what `nproc` prints)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def can_fork() -> bool:
    # The second process starts as a copy of this one: with the policy loaded and everything imported,
    # not with a fresh interpreter importing it all again.
    return "fork" in multiprocessing.get_all_start_methods()


def detach(receive: Connection) -> None:
    """First thing in a forked helper. Its copy of the pipe's reading end is closed: should the other
    process die, sending fails instead of blocking for good once the pipe is full. Ctrl-C is the
    other's to handle: it stops the helper."""
    receive.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def hand_over(take: Callable[[], T | None], send: Callable[[T], None], pipe: Connection) -> None:
    """A forked helper's sender thread: sends what `take` gives until it gives None, then closes
    `pipe`. A thread, so that the helper goes on working while the other has yet to take what was
    sent. Should the other process be gone, the helper ends: nobody is left to work for."""
    try:
        while (message := take()) is not None:
            send(message)
    except OSError:
        os._exit(1)
    pipe.close()
