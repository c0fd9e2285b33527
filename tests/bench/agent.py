"""The node agent's cost on a GPU node: CPU (% of one core) and memory (RSS) of `medic agent`.

`PYTHONPATH=tests python -m bench.agent` prints a markdown table. The agent runs as on a node (NVML for 8 GPUs with
18 NVLink links each, a kernel-log file, a JSON-lines sink) but with NVML answered by the shim of
tests/nvml_shim (no GPU here): the figures are the agent's own Python work plus the shim's, and on
a real node the driver's time per NVML call comes on top (the table gives the calls per poll).

Polling every 15 s for long enough to measure is slow, so the agent polls every second for 30 s
(and ten times a second for 10 s, to time one poll); CPU per poll over 15 s gives the 15 s figure,
plus what the agent costs between polls (measured with polls an hour apart).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nvml_support import ShimState, build_shim, shim_env

from bench import REPO_ROOT
from bench.report import num, table

POLL_S = 1.0
MEASURE_S = 30.0
# CPU time of another process comes in 10 ms ticks: ~30 polls of ~2 ms are too few to time each
# poll well, so CPU per poll is taken from a run that polls ten times a second.
FAST_POLL_S = 0.1
SHORT_MEASURE_S = 10.0
DEFAULT_INTERVAL_S = 15.0
TARGET_CPU_PCT = 0.5
TARGET_RSS_MB = 80.0
CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
LEAN = [sys.executable, "-m", "medic.apps.cli.agent"]
# `medic agent` as the console script runs it: medic/apps/cli/app.py's `main`, which loads that command alone.
MEDIC_AGENT = [
    sys.executable,
    "-c",
    "import sys; from medic.apps.cli.app import main; sys.argv[1:1] = ['agent']; main()",
]


def _cpu_s(pid: int) -> float:
    """utime + stime: the kernel counts them in clock ticks (10 ms), hence the fast run below."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S


def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no {field} for {pid}")


def measure(agent_command: list[str], interval_s: float, seconds: float, workdir: Path) -> dict[str, float]:
    """Start the agent (`agent_command` and its options), wait for its first NVML read, then watch it
    for `seconds`."""
    state = ShimState(workdir / "nvml-state")
    calls_file, log_file = workdir / "nvml-calls", workdir / "agent.log"
    kmsg = workdir / "kmsg"
    kmsg.touch()
    env = shim_env(build_shim(workdir / "shim"), state) | {"MEDIC_NVML_SHIM_CALLS": str(calls_file)}
    command = [
        *agent_command,
        f"--interval={interval_s}",
        f"--kmsg={kmsg}",
        f"--sink={workdir / 'events.jsonl'}",
        "--node=bench-node",
    ]
    started = time.monotonic()
    with log_file.open("w") as log:
        agent = subprocess.Popen(command, env=env, stderr=log, cwd=REPO_ROOT)
    try:
        while "NVML answers" not in log_file.read_text():
            if agent.poll() is not None or time.monotonic() - started > 60:
                raise RuntimeError(f"the agent did not start:\n{log_file.read_text()}")
            time.sleep(0.01)
        ready_s = time.monotonic() - started
        cpu_before, t_before = _cpu_s(agent.pid), time.monotonic()
        time.sleep(seconds)
        cpu_after, t_after = _cpu_s(agent.pid), time.monotonic()
        rss, peak = _rss_mb(agent.pid), _rss_mb(agent.pid, "VmHWM")
        polls_total = 1 + (t_after - started) / interval_s
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
    calls = int(calls_file.read_text()) if calls_file.exists() else 0
    wall = t_after - t_before
    return {
        "ready_s": ready_s,
        "cpu_s": cpu_after - cpu_before,
        "wall_s": wall,
        "polls": wall / interval_s,
        "rss_mb": rss,
        "peak_mb": peak,
        "calls_per_poll": calls / polls_total,
    }


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="medic-bench-agent-") as tmp:
        root = Path(tmp)
        runs = {}
        for name, entry, interval, seconds in [
            ("polling", LEAN, POLL_S, MEASURE_S),
            ("fast", LEAN, FAST_POLL_S, SHORT_MEASURE_S),
            ("idle", LEAN, 3600.0, SHORT_MEASURE_S),
            ("medic_agent", MEDIC_AGENT, POLL_S, SHORT_MEASURE_S),
        ]:
            workdir = root / name
            workdir.mkdir()
            runs[name] = measure(entry, interval, seconds, workdir)
    fast, idle = runs["fast"], runs["idle"]
    idle_pct = 100 * idle["cpu_s"] / idle["wall_s"]
    between_polls_s = idle["cpu_s"] / idle["wall_s"] * fast["wall_s"]
    per_poll_s = max(0.0, fast["cpu_s"] - between_polls_s) / fast["polls"]
    return {
        **runs,
        "cpu_per_poll_ms": per_poll_s * 1000,
        "cpu_pct_at_1s": 100 * runs["polling"]["cpu_s"] / runs["polling"]["wall_s"],
        "cpu_pct_idle": idle_pct,
        "cpu_pct_at_15s": idle_pct + 100 * per_poll_s / DEFAULT_INTERVAL_S,
    }


def section(results: dict[str, Any]) -> str:
    polling, medic_agent = results["polling"], results["medic_agent"]
    at_15 = results["cpu_pct_at_15s"]
    rss = max(polling["peak_mb"], results["idle"]["peak_mb"])
    rows = [
        (
            f"CPU per poll (8 GPUs, shim; {results['fast']['polls']:.0f} polls)",
            f"{num(results['cpu_per_poll_ms'])} ms",
            "",
        ),
        ("NVML calls per poll", num(polling["calls_per_poll"]), ""),
        (
            f"CPU, polling every {POLL_S:g} s (measured {MEASURE_S:g} s)",
            f"{num(results['cpu_pct_at_1s'])} %",
            "",
        ),
        ("CPU between polls (measured)", f"{num(results['cpu_pct_idle'])} %", ""),
        (
            f"CPU, polling every {DEFAULT_INTERVAL_S:g} s (derived)",
            f"{num(at_15)} %",
            f"< {TARGET_CPU_PCT} %: {'met' if at_15 < TARGET_CPU_PCT else 'MISSED'}",
        ),
        (
            "RSS, `python -m medic.apps.cli.agent` (peak)",
            f"{num(rss)} MB",
            f"< {TARGET_RSS_MB:g} MB: {'met' if rss < TARGET_RSS_MB else 'MISSED'}",
        ),
        (
            "RSS, `medic agent` (peak)",
            f"{num(medic_agent['peak_mb'])} MB",
            f"< {TARGET_RSS_MB:g} MB: {'met' if medic_agent['peak_mb'] < TARGET_RSS_MB else 'MISSED'}",
        ),
        ("start to first NVML read", f"{num(polling['ready_s'])} s", ""),
    ]
    return "\n".join(
        [
            "## Node agent overhead",
            "",
            f"`medic agent` against the NVML shim (tests/bench/agent.py). CPU is % of one core; the "
            f"{DEFAULT_INTERVAL_S:g} s figure",
            "is CPU per poll / interval + the CPU between polls. On a real node add the driver's time for",
            "each NVML call.",
            "",
            table(["measure", "value", "target"], rows),
        ]
    )


if __name__ == "__main__":
    print(section(run()))
