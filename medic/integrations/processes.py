"""Local processes for launchers: a free loopback port, and finding and killing process trees.

torchrun starts each worker in its own session, so killing torchrun's process group leaves the
workers running; they are found through /proc (children by parent id) and killed by pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
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


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name, or None once the pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process for good."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def running(pid: int, started: int) -> bool:
    """Whether that process still runs: a zombie has finished, even if nobody has reaped it yet."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X") and int(fields[19]) == started


def kill(pid: int, started: int | None = None) -> None:
    """SIGKILL `pid`, unless it has exited or (given `started`) the pid now names another process."""
    if started is not None and start_time(pid) != started:
        return
    with contextlib.suppress(ProcessLookupError):  # it exited on its own meanwhile
        os.kill(pid, signal.SIGKILL)


def wait_gone(processes: dict[int, int], timeout_s: float) -> list[int]:
    """Wait for the processes (pid -> start time) to finish; the pids still running at the timeout."""
    deadline = time.monotonic() + timeout_s
    while (left := [pid for pid, started in processes.items() if running(pid, started)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.02)  # SIGKILL is delivered asynchronously; a busy machine takes a moment
    return left
