"""Local processes for launchers: a free loopback port, and finding and killing process trees.

torchrun starts each worker in its own session, so killing torchrun's process group leaves the
workers running; they are found through /proc (children by parent id) and killed by pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def kill(pid: int, started: int | None = None) -> None:
    """SIGKILL `pid`, unless it has exited or (given `started`) the pid now names another process."""
    if started is not None and start_time(pid) != started:
        return
    with contextlib.suppress(ProcessLookupError):  # it exited on its own meanwhile
        os.kill(pid, signal.SIGKILL)
