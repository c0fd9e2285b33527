"""`medic serve` in a process of its own, on a free port: for the tests that reach it over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

TOKEN = "s3cret-token"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def server_process(
    database: Path, port: int, extra_env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`medic serve` (the CLI function under typer) in its own process."""
    env = os.environ | {"MEDIC_DATABASE_URL": f"sqlite:///{database}", "MEDIC_INGEST_TOKENS": TOKEN}
    env |= extra_env or {}
    code = "import typer; from medic.apps.cli.serve import serve; typer.run(serve)"
    process = subprocess.Popen(
        [sys.executable, "-c", code, "--port", str(port), "--log-level", "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, f"the server exited with {process.returncode}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()  # not SIGKILL: its embedded Prefect server would outlive it
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        process.wait(timeout=10)
