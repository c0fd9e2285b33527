"""The processes that hold claims in the store (an incident's lease, chat messages in the outbox),
named "host:role:pid": a claim left by a process that is gone is taken back at once on its host,
without waiting for it to lapse."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable


def runner_name(role: str) -> str:
    """The name claims are held under: host, role (e.g. the port serve listens on) and process."""
    return f"{socket.gethostname()}:{role}:{os.getpid()}"


def dead_runners(runners: Iterable[str], me: str) -> set[str]:
    """Of `runners`, those of `me`'s host and role whose process is gone (a predecessor killed)."""
    host, role, _ = me.rsplit(":", 2)
    dead = set()
    for runner in runners:
        their_host, their_role, pid = runner.rsplit(":", 2) if runner.count(":") >= 2 else ("", "", "")
        if (their_host, their_role) == (host, role) and pid.isdigit() and not _alive(int(pid)):
            dead.add(runner)
    return dead


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
