"""The node bundle as a GPU node installs it: its size on disk and its agent's memory.

`PYTHONPATH=tests python -m bench node_bundle` builds the wheel from this checkout, installs `gpu-medic[node]` and, for
comparison, `gpu-medic[server]` into fresh virtualenvs (pip's cache warm: the time is not the figure),
measures each virtualenv on disk against a bare one, and runs the node bundle's `medic agent` (its
console script, as systemd starts it) against the NVML shim of tests/nvml_shim for 20 s at 1 s polls
(tests/bench/agent.py's `measure`: peak RSS from /proc's VmHWM).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import REPO_ROOT
from bench.agent import POLL_S, TARGET_RSS_MB, measure
from bench.report import num, table

MEASURE_S = 20.0
SERVER_ONLY = ("prefect", "sqlalchemy", "fastapi", "uvicorn", "psycopg")


def _run(command: list[str], cwd: Path) -> str:
    return subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True, timeout=1800).stdout


def _size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink()) / 1e6


def _venv(where: Path, requirement: str | None) -> tuple[float, list[str]]:
    """A fresh virtualenv with `requirement` installed: its size (MB) and its distributions."""
    _run([sys.executable, "-m", "venv", str(where)], where.parent)
    python = str(where / "bin" / "python")
    if requirement is not None:
        _run(
            [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", requirement],
            where.parent,
        )
    listed = json.loads(_run([python, "-m", "pip", "list", "--format=json"], where.parent))
    return _size_mb(where), sorted(p["name"].lower() for p in listed)


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="medic-bench-bundle-") as tmp:
        root = Path(tmp)
        _run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(root), str(REPO_ROOT)],
            root,
        )
        (wheel,) = root.glob("gpu_medic-*.whl")
        bare_mb, _ = _venv(root / "bare", None)
        node_mb, node_packages = _venv(root / "node", f"{wheel}[node]")
        server_mb, server_packages = _venv(root / "server", f"{wheel}[server]")
        workdir = root / "agent"
        workdir.mkdir()
        agent = measure([str(root / "node" / "bin" / "medic"), "agent"], POLL_S, MEASURE_S, workdir)
        wheel_kb = wheel.stat().st_size / 1e3
    return {
        "wheel_kb": wheel_kb,
        "bare_mb": bare_mb,
        "node_mb": node_mb,
        "server_mb": server_mb,
        "node_packages": node_packages,
        "server_packages": len(server_packages),
        "agent": agent,
    }


def section(results: dict[str, Any]) -> str:
    agent, bare = results["agent"], results["bare_mb"]
    leaked = [name for name in results["node_packages"] if name in SERVER_ONLY]
    rows = [
        ("the wheel", f"{num(results['wheel_kb'])} kB"),
        (
            "`gpu-medic[node]` virtualenv, less a bare one",
            f"{num(results['node_mb'] - bare)} MB ({len(results['node_packages'])} distributions)",
        ),
        (
            "`gpu-medic[server]` virtualenv, less a bare one",
            f"{num(results['server_mb'] - bare)} MB ({results['server_packages']} distributions)",
        ),
        ("control-plane packages in the node bundle", ", ".join(leaked) or "none"),
        (
            f"`medic agent` from the node bundle, peak RSS ({MEASURE_S:g} s at {POLL_S:g} s polls, 8 GPUs, shim)",
            f"{num(agent['peak_mb'])} MB (target < {TARGET_RSS_MB:g} MB: "
            f"{'met' if agent['peak_mb'] < TARGET_RSS_MB else 'MISSED'})",
        ),
        ("its start to first NVML read", f"{num(agent['ready_s'])} s"),
    ]
    return "\n".join(
        [
            "## The node bundle",
            "",
            "`pip install 'gpu-medic[node]'` from the wheel, in a fresh virtualenv (tests/bench/node_bundle.py); sizes",
            "are the files under the virtualenv less a bare one's (pip and its own files). Distributions:",
            ", ".join(results["node_packages"]) + ".",
            "",
            table(["measure", "value"], rows),
        ]
    )


if __name__ == "__main__":
    print(section(run()))
