"""Prefect's embedded API server left behind by a `medic serve` killed with SIGKILL.

The embedded server is a child process (uvicorn) that Prefect ends from an exit hook, which a
SIGKILL, an OOM kill or a crash never runs: the child goes on serving Prefect's database for
nobody, and a restarted service starts a second one on the same database. Each service marks the
embedded server it starts with its own identity (pid and start time, in the environment the
child inherits), and a service starting ends the embedded servers whose service is gone. Only
those: a training job a service launched carries the mark too and must outlive any restart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path

from medic.integrations.processes import kill, running, start_time, wait_gone

log = logging.getLogger("medic.serve")

OWNER_ENV = "MEDIC_SERVE_PROCESS"
# Prefect's embedded server runs this factory, with this variable set (prefect.server.api.server).
_FACTORY = b"prefect.server.api.server:create_app"
_EPHEMERAL = b"PREFECT__SERVER_EPHEMERAL=1"
_GRACE_S = 5.0


def claim() -> None:
    """Mark the embedded server this process may start as its own, and end those left by a
    service that is gone (SIGTERM, then SIGKILL after a grace)."""
    me = os.getpid()
    os.environ[OWNER_ENV] = f"{me}:{start_time(me)}"
    left = dict(_orphans())
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for pid in wait_gone(left, _GRACE_S):
        kill(pid, left[pid])
    for pid in left:
        log.warning("ended Prefect's embedded server (pid %d) left by a medic serve that is gone", pid)


def _orphans() -> list[tuple[int, int]]:
    """Embedded servers (pid, start time) whose marked service no longer runs."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # another user's process, or one that ended meanwhile: not ours to look at
            if _FACTORY not in (entry / "cmdline").read_bytes():
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        owner = next((v for v in environ if v.startswith(f"{OWNER_ENV}=".encode())), None)
        if _EPHEMERAL not in environ or owner is None:
            continue  # a server someone runs on purpose, or one no medic serve started
        pid, _, started = owner.split(b"=", 1)[1].decode().partition(":")
        if started.isdigit() and pid.isdigit() and running(int(pid), int(started)):
            continue
        child = start_time(int(entry.name))
        if child is not None:
            found.append((int(entry.name), child))
    return found
