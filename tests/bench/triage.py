"""Events per second through `medic triage`: the real CLI end to end, and the pipeline in process.

A generated JSONL feed (valid events of every kind, in bursts over ~500 nodes and a week) goes
through `.venv/bin/medic triage FILE --json > /dev/null` as a subprocess; then the same file goes
through the in-process pipeline stage by stage (read_file, correlate, facts_of, decide, JSON out)
to show where the time goes. Last, a feed ten times as large goes through the CLI once, for its
throughput and peak memory (the command streams: memory follows the windows, not the file).
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench import REPO_ROOT
from bench.report import Stats, num, rate, table
from medic.events import event_time

EVENTS = 100_000
STREAM_EVENTS = 1_000_000
NODES = 500
CLI_REPEATS = 5
INPROCESS_REPEATS = 5
POLICY = REPO_ROOT / "policies" / "default.yaml"
TOTAL = "total (read_file + triage + JSON out)"
TARGET_RATE = 20_000  # events/s
TARGET_RSS = 200 * 2**20  # bytes, for STREAM_EVENTS
START = datetime(2026, 11, 1, tzinfo=UTC)

KIND_WEIGHTS = {
    "xid": 14,
    "dcgm_health": 9,
    "ecc": 9,
    "nccl_timeout": 15,
    "nan_loss": 3,
    "straggler": 15,
    "thermal": 8,
    "gpu_missing": 2,
    "node_unreachable": 2,
    "job_crash": 8,
    "health_check": 6,
    "diagnostic": 3,
    "remediation": 3,
}
XIDS = [79, 79, 48, 13, 31, 43, 94, 63, 64, 92, 119, 74]
DCGM = ["DCGM_FR_NVLINK_ERROR_THRESHOLD", "DCGM_FR_NVLINK_DOWN", "DCGM_FR_PENDING_PAGE_RETIREMENTS", 5, 14, 3]
SOURCES = {
    "xid": "agent",
    "dcgm_health": "dcgm",
    "ecc": "dcgm",
    "diagnostic": "medic",
    "remediation": "medic",
}
JOB_KINDS = {"nccl_timeout", "nan_loss", "straggler", "job_crash"}


def random_attributes(kind: str, rng: random.Random) -> dict[str, Any]:
    match kind:
        case "xid":
            code = rng.choice(XIDS)
            return {
                "code": code,
                "message": f"NVRM: Xid (PCI:0000:{rng.randrange(256):02x}:00): {code}, pid=1234",
            }
        case "dcgm_health":
            return {"error_id": rng.choice(DCGM), "message": "health watch"}
        case "ecc":
            return {"sbe": rng.randrange(1, 40), "dbe": 1 if rng.random() < 0.2 else 0}
        case "straggler":
            return {"step_time_ratio": round(rng.uniform(1.05, 1.8), 3)}
        case "thermal":
            return {
                "temperature_c": round(rng.uniform(84, 96), 1),
                "throttle_reasons": ["hw_slowdown", "sw_thermal"],
            }
        case "gpu_missing":
            return {"expected": 8, "found": rng.randrange(6, 8)}
        case "job_crash":
            return {"exit_code": rng.choice([1, 134, 137, 139])}
        case "health_check":
            return {
                "phase": rng.choice(["prolog", "epilog", "healthcheck"]),
                "check": "nvidia-smi",
                "message": "slow",
            }
        case "diagnostic":
            failed = rng.random() < 0.4
            return {
                "level": rng.randrange(1, 4),
                "result": "fail" if failed else "pass",
                "error_ids": [14] if failed else [],
            }
        case "remediation":
            return {"action": rng.choice(["reboot", "reset_gpu"])}
    return {}


def generate(path: Path, count: int = EVENTS, nodes: int = NODES, seed: int = 11) -> int:
    """Write `count` valid events in bursts (1-16 events on one node within minutes), sorted by time."""
    rng = random.Random(seed)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    events: list[dict[str, Any]] = []
    while len(events) < count:
        n = rng.randrange(1, nodes + 1)
        node, job = f"gpu-node-{n:03d}", f"job-{(n - 1) // 8}"
        at = START + timedelta(seconds=rng.uniform(0, 7 * 86_400))
        for _ in range(min(rng.randrange(1, 17), count - len(events))):
            kind = rng.choices(kinds, weights)[0]
            at += timedelta(seconds=rng.uniform(0, 90))
            event: dict[str, Any] = {
                "id": f"ev-{len(events):07d}",
                "time": event_time(at),
                "source": "job" if kind in JOB_KINDS else SOURCES.get(kind, "agent"),
                "kind": kind,
                "node": node,
                "gpu": rng.randrange(8),
                "switch": f"leaf-{(n - 1) // 16 + 1}",
            }
            if kind in JOB_KINDS:
                event.update(job=job, rank=rng.randrange(64), iteration=rng.randrange(1, 200_000))
            event["attributes"] = random_attributes(kind, rng)
            events.append(event)
    events.sort(key=lambda e: e["time"])
    with path.open("w", encoding="utf-8") as handle:
        for event in events:
            handle.write(json.dumps(event) + "\n")
    return len(events)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def run_cli(path: Path) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one `medic triage PATH --json > /dev/null`.

    The peak is the child's own `VmHWM`, read while it runs: its `ru_maxrss` would count the pages
    of this process it was forked from."""
    medic = Path(sys.executable).parent / "medic"
    env = {**os.environ, "MEDIC_POLICY": str(POLICY)}
    peak = 0
    with tempfile.TemporaryFile() as errors:
        start = time.perf_counter()
        child = subprocess.Popen(
            [str(medic), "triage", str(path), "--json"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=errors,
        )
        while child.poll() is None:
            peak = max(peak, _high_water(child.pid))
            time.sleep(0.02)
        seconds = time.perf_counter() - start
        if child.returncode != 0:
            errors.seek(0)
            raise RuntimeError(f"medic triage failed ({child.returncode}): {errors.read()[-2000:]!r}")
    return seconds, peak


def _high_water(pid: int) -> int:
    """A running process's peak resident memory so far, in bytes (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(found[1]) * 1024 if found else 0


def time_cli(path: Path, repeats: int) -> Stats:
    """Wall seconds of `medic triage PATH --json > /dev/null`, one sample per run."""
    return Stats.of([run_cli(path)[0] for _ in range(repeats)])


class _Laps:
    """Consecutive stopwatch laps: `lap(name)` records the seconds since the previous lap."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.restart()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now


def _one_pass(path: Path) -> tuple[dict[str, float], dict[str, Any]]:
    """The stages `medic triage --json` runs, timed one by one; then all of them as the CLI runs them."""
    from medic.facts import facts_of
    from medic.incidents import correlate
    from medic.intake import read_file
    from medic.policy import decide, load_policy
    from medic.triage import triage, triage_line

    with path.open(encoding="utf-8") as handle:
        lines = handle.readlines()
    clock = _Laps()
    for line in lines:
        json.loads(line)
    clock.lap("json.loads only")

    clock.restart()
    loaded = load_policy(POLICY)
    clock.lap("load_policy")
    intake = read_file(path)
    clock.lap("read_file")
    window = timedelta(minutes=loaded.policy.defaults.incident_window_minutes)
    incidents = correlate(intake.events, window)
    clock.lap("correlate")
    facts = [facts_of(i) for i in incidents]
    clock.lap("facts_of")
    decisions = [decide(loaded.policy, f, loaded.sha256) for f in facts]
    clock.lap("decide")
    sink = io.StringIO()
    for incident, decision in zip(incidents, decisions, strict=True):
        sink.write(triage_line(incident, decision).model_dump_json() + "\n")
    clock.lap("triage_line + JSON out")
    matched = sum(len(d.matched) for d in decisions) / len(decisions)
    if intake.rejected or intake.duplicates:
        raise RuntimeError(f"generated events not all accepted: {intake.rejected[:3]}")

    # The whole thing in the CLI's own sequence, for the total.
    del intake, incidents, facts, decisions
    clock.restart()
    intake = read_file(path)
    results = list(triage(intake.events, load_policy(POLICY)))
    sink = io.StringIO()
    for incident, decision in results:
        sink.write(triage_line(incident, decision).model_dump_json() + "\n")
    clock.lap(TOTAL)
    info = {
        "events": len(intake.events),
        "incidents": len(results),
        "output_bytes": len(sink.getvalue()),
        "matched": matched,
    }
    return clock.laps, info


def time_pipeline(path: Path, repeats: int) -> dict[str, Any]:
    """`repeats` passes of `_one_pass`: Stats per stage."""
    stages: dict[str, list[float]] = {}
    info: dict[str, Any] = {}
    for _ in range(repeats):
        laps, info = _one_pass(path)
        for name, seconds in laps.items():
            stages.setdefault(name, []).append(seconds)
    return {"stages": {name: Stats.of(s) for name, s in stages.items()}, **info}


def time_startup(directory: Path, repeats: int) -> Stats:
    """The CLI's fixed cost: the same command on a one-event file."""
    tiny = directory / "one-event.jsonl"
    generate(tiny, count=1)
    return time_cli(tiny, repeats)


def time_stream(directory: Path, events: int) -> dict[str, Any]:
    """One CLI run over a feed of `events`, against the same command on a one-event file."""
    path = directory / "stream.jsonl"
    generate(path, events)
    seconds, peak = run_cli(path)
    _, baseline = run_cli(directory / "one-event.jsonl")
    return {
        "events": events,
        "bytes": path.stat().st_size,
        "seconds": seconds,
        "peak": peak,
        "baseline": baseline,
    }


def run(events: int = EVENTS, stream_events: int = STREAM_EVENTS) -> dict[str, Any]:
    load = os.getloadavg()[:2]
    with tempfile.TemporaryDirectory(prefix="medic-bench-triage-") as tmp:
        path = Path(tmp) / "events.jsonl"
        seconds, written = _timed(lambda: generate(path, events))
        size = path.stat().st_size
        startup = time_startup(Path(tmp), CLI_REPEATS)
        cli = time_cli(path, CLI_REPEATS)
        pipeline = time_pipeline(path, INPROCESS_REPEATS)
        path.unlink()
        streamed = time_stream(Path(tmp), stream_events)
    return {
        "load": (*load, *os.getloadavg()[:2]),
        "stream": streamed,
        "events": written,
        "nodes": NODES,
        "file_bytes": size,
        "generate_s": seconds,
        "startup": startup,
        "cli": cli,
        **pipeline,
    }


def section(r: dict[str, Any]) -> str:
    n = r["events"]
    cli, startup = r["cli"], r["startup"]
    cli_rate = rate(n, cli)
    stages: dict[str, Stats] = r["stages"]
    total = stages[TOTAL]
    cli_rows = [
        [
            "`medic triage FILE --json > /dev/null` (subprocess)",
            f"**{num(cli_rate.median)}**",
            f"{num(cli_rate.low)} - {num(cli_rate.high)}",
            f"{num(cli.median)} s",
            f"{num(cli.low)} - {num(cli.high)} s",
            cli.n,
        ],
        [
            "same command on a 1-event file (fixed cost)",
            "-",
            "-",
            f"{num(startup.median)} s",
            f"{num(startup.low)} - {num(startup.high)} s",
            startup.n,
        ],
    ]
    order = [
        "load_policy",
        "read_file",
        "json.loads only",
        "correlate",
        "facts_of",
        "decide",
        "triage_line + JSON out",
    ]
    stage_rows = []
    for name in [*order, TOTAL]:
        s = stages[name]
        share = "-" if name in ("json.loads only", TOTAL) else f"{s.median / total.median:.0%}"
        label = "(part of read_file: `json.loads` alone)" if name == "json.loads only" else name
        per = r["incidents"] if name in ("facts_of", "decide", "triage_line + JSON out") else n
        stage_rows.append(
            [
                label,
                f"{num(s.median)} s",
                f"{num(s.low)} - {num(s.high)} s",
                share,
                "-" if name == "load_policy" else f"{num(per / s.median)}/s",
            ]
        )
    inproc = rate(n, total)
    rest = cli.median - total.median - startup.median
    read, loads = stages["read_file"], stages["json.loads only"]
    spread = (cli.high - cli.low) + (total.high - total.low)
    if abs(rest) <= spread:
        remainder = "within the run-to-run spread of the two measurements"
    else:
        remainder = (
            f"the cost of writing {r['output_bytes'] / 1e6:.1f} MB of JSON lines through stdout, and noise"
        )
    validate_us = (read.median - loads.median) / n * 1e6
    return "\n".join(
        [
            "## 2. Events per second through `medic triage`",
            "",
            f"A generated feed of {n:,} valid events ({r['file_bytes'] / 1e6:.1f} MB JSONL; all 13 kinds with",
            f"realistic attributes, in bursts of 1-16 events on one of {r['nodes']} nodes, spread over a week)",
            f"correlates into {r['incidents']:,} incidents. events/s = events / wall seconds.",
            "",
            table(
                [
                    "end to end",
                    "events/s (median)",
                    "min - max",
                    "wall (median)",
                    "wall min - max",
                    "repeats",
                ],
                cli_rows,
            ),
            "",
            f"In process, the same file stage by stage (median of {total.n} repeats); the total runs the",
            "CLI's own sequence (`read_file`, `medic.triage.triage`, `triage_line(...).model_dump_json()`)",
            f"and comes to **{num(inproc.median)} events/s**. Rates are per event for reading and per",
            "incident after correlation.",
            "",
            table(["stage", "median", "min - max", "share of total", "rate"], stage_rows),
            "",
            f"`read_file` takes {num(read.median)} s, of which {num(loads.median)} s is `json.loads`; the rest,",
            f"about {num(validate_us)} µs per event, is `FaultEvent` validation (envelope and per-kind",
            "attributes) and the duplicate check.",
            "",
            f"The CLI's median wall time ({num(cli.median)} s) against the in-process total ({num(total.median)} s)",
            f"plus its fixed cost ({num(startup.median)} s on a one-event file: interpreter, imports, policy",
            f"load) leaves {num(rest)} s, {remainder}.",
            "",
            f"`decide` manages {num(r['incidents'] / stages['decide'].median)} incidents/s here. This feed's incidents",
            "are bigger than section 1's mix (bursts of up to 16 mixed events), so more rules match:",
            f"{r['matched']:.1f} per decision on average (section 1 gives its mix's figure), and every match",
            "builds its reason strings.",
            "",
            *_stream_section(r["stream"], r["load"]),
        ]
    )


def _stream_section(s: dict[str, Any], load: tuple[float, ...]) -> list[str]:
    n, mb = s["events"], 2**20
    events_per_s = n / s["seconds"]
    above = (s["peak"] - s["baseline"]) / n
    verdicts = [
        f"{'meets' if events_per_s >= TARGET_RATE else 'does not meet'} ≥{TARGET_RATE:,} events/s",
        f"{'meets' if s['peak'] <= TARGET_RSS else 'does not meet'} ≤{TARGET_RSS // mb} MB",
    ]
    return [
        f"### Streaming {n:,} events",
        "",
        f"The same generator, {n:,} events ({s['bytes'] / 1e6:.0f} MB), one run of the CLI as above; peak RSS",
        "is the child's `VmHWM` (read every 20 ms while it runs), against the same command on a one-event file.",
        "",
        table(
            ["events", "wall", "events/s", "peak RSS", "one-event run", "RSS above it, per input event"],
            [
                [
                    f"{n:,}",
                    f"{num(s['seconds'])} s",
                    f"**{num(events_per_s)}**",
                    f"**{s['peak'] / mb:.0f} MB**",
                    f"{s['baseline'] / mb:.0f} MB",
                    f"{above:.0f} bytes",
                ]
            ],
        ),
        "",
        f"This run {' and '.join(verdicts)} (load average 1/5 min {load[0]:.2f}/{load[1]:.2f} before this",
        f"benchmark, {load[2]:.2f}/{load[3]:.2f} after it).",
    ]
