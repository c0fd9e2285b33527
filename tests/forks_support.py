"""A command's forked helper process must not outlive it: killed, the command leaves no orphan behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY = "ready"  # what a script prints once its helper process is working


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # ended, waiting to be reaped


def assert_helper_ends_with_its_parent(script: Path, *args: str) -> None:
    """Run `script`, which forks one helper and prints READY while that one still has work to hand
    over; kill the script once the helper has filled the pipe between them; the helper must end."""
    parent = subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    helper = None
    try:
        assert parent.stdout is not None and parent.stdout.readline() == f"{READY}\n"
        (helper,) = _children(parent.pid)
        time.sleep(1)  # it fills the pipe and waits for a reader that takes nothing more
        assert not _gone(helper)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while not _gone(helper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(helper), "the forked process outlived the one it works for"
    finally:
        parent.kill()
        parent.wait()
        if helper is not None and not _gone(helper):
            os.kill(helper, signal.SIGKILL)  # an orphan must not outlive a failed test either
