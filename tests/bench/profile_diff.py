"""Why a rank is slow, from its profile against a healthy peer's (medic/profile_diff.py), on real
torch.profiler traces of the reference job under a real torchrun: 2 ranks on the CPU, gloo.

Each run slows rank 1 with one named cause (`train.py --inject-slow`), or none (the control), and
profiles both ranks over the same steps the way GPU Medic asks for it: a request file for each rank
dropped into the profile directory while the job runs. The two traces go through
`medic.profile_diff.diagnose`, and the verdict is checked against the cause injected.

Also measured: the always-on cost on the rank (the hooks' calls per step against the job's step
time) and what a profiled pair costs (its steps' extra time, and the steps after it against those
before it).

`PYTHONPATH=tests python -m bench.profile_diff [RUNS [FOLDER]]` prints the section (RUNS of each cause and the control,
10 by default; FOLDER keeps every run's traces); `PYTHONPATH=tests python -m bench "profile diff"` runs 3 of each.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import cpu_model
from bench.resume import job_command
from medic.integrations.processes import descendants, kill
from medic.profile_diff import Cause, ProfileDiff, diagnose
from medic.training.medic_hooks import PROFILE_REQUEST_SUFFIX, MedicHooks

JOB = "reference-train"
SUSPECT, PEER = 1, 0
PROFILE_STEPS = 10
# A call (compute, copy), a batch (input), a step (python): above the 5% of a step the diff asks
# for even when a shared machine's load doubles the step.
INJECT_MS = 5.0
TIMINGS_EVERY = 10
WARM_STEPS = 20  # the request files are written once the job has made these
GIVE_UP_S = 120
EXPECTED = {
    "compute": Cause.HARDWARE_COMPUTE,
    "copy": Cause.HARDWARE_IO,
    "input": Cause.SOFTWARE_INPUT,
    "python": Cause.SOFTWARE_PYTHON,
    "none": Cause.NONE,
}
DEFAULT_RUNS = 3


@dataclass(frozen=True, slots=True)
class PairRun:
    """One run's traces of the suspect and its peer, and the job's own step-time reports."""

    workdir: Path
    suspect: Path
    peer: Path
    seconds: float

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.workdir / "events.jsonl").read_text().splitlines()]

    def diff(self) -> ProfileDiff:
        return diagnose(self.suspect, self.peer)


def _stop(process: subprocess.Popen[str]) -> None:
    for pid in [*descendants(process.pid), process.pid]:
        kill(pid)
    process.wait()


def _steps_made(losses: Path) -> int:
    return losses.read_text().count("\n") if losses.exists() else 0


def _requested(events: Path) -> dict[int, Path]:
    """The ranks whose requested profile is written, and its trace."""
    found: dict[int, Path] = {}
    if events.exists():
        text = events.read_text()
        for line in text[: text.rfind("\n") + 1].splitlines():  # a line still being written waits
            event = json.loads(line)
            attributes = event.get("attributes", {})
            if attributes.get("check") == "profile" and attributes.get("reason") == "requested":
                found[event["rank"]] = Path(attributes["artifact"])
    return found


def profile_pair(
    workdir: Path, cause: str, steps: int = PROFILE_STEPS, after: int = 4 * TIMINGS_EVERY
) -> PairRun:
    """Run the job with `cause` on rank 1 (`none`: no cause), ask both ranks for a profile of
    `steps` steps once it is warm, and stop it `after` steps after both traces are reported."""
    workdir.mkdir(parents=True, exist_ok=True)
    artifacts = workdir / "artifacts"
    injected = [] if cause == "none" else [f"--inject-slow={cause}", f"--inject-rank={SUSPECT}"]
    command = [
        *job_command(workdir, 2),
        f"--artifacts={artifacts}",
        "--steps=100000",  # stopped once the traces are in
        "--ckpt-every=100000",
        "--stall-dump-s=0",
        f"--timings-every={TIMINGS_EVERY}",
        f"--profile-steps={PROFILE_STEPS}",
        f"--inject-ms={INJECT_MS}",
        *injected,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_DEVICE": "cpu"}
    began = time.monotonic()
    with (workdir / "torchrun.log").open("w") as log:
        process = subprocess.Popen(
            command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
    try:
        asked = False
        while (traces := _requested(workdir / "events.jsonl")).keys() < {SUSPECT, PEER}:
            if time.monotonic() - began > GIVE_UP_S or process.poll() is not None:
                raise RuntimeError(f"no pair of profiles in {workdir} (see torchrun.log)")
            if not asked and _steps_made(workdir / "losses.jsonl") >= 2 * WARM_STEPS:
                for rank in (SUSPECT, PEER):
                    # Written aside and renamed in, as the hooks ask: never read half-written.
                    request = artifacts / f"{JOB}-r{rank}{PROFILE_REQUEST_SUFFIX}"
                    aside = request.with_name(request.name + ".part")
                    aside.write_text(json.dumps({"steps": steps}))
                    os.replace(aside, request)
                asked = True
            time.sleep(0.1)
        # The steps that follow the profile, for its cost (the loss log has a line per step and rank).
        stop_at = _steps_made(workdir / "losses.jsonl") + 2 * after
        while _steps_made(workdir / "losses.jsonl") < stop_at and process.poll() is None:
            time.sleep(0.1)
    finally:
        _stop(process)
    return PairRun(workdir, traces[SUSPECT], traces[PEER], time.monotonic() - began)


def _step_times(run: PairRun, rank: int) -> dict[int, float]:
    """Step -> seconds, from the rank's step-timing reports (its own measure of every step)."""
    times: dict[int, float] = {}
    for event in run.events():
        attributes = event.get("attributes", {})
        if event.get("rank") == rank and attributes.get("check") == "step_timings":
            first = attributes["first_step"]
            times |= {first + i: t for i, t in enumerate(attributes["step_times_s"])}
    return times


def _profile_cost(run: PairRun) -> dict[str, float]:
    """The peer's profiled steps, the 20 before them and the 20 after (its own, uninjected work)."""
    profiled = {
        e["attributes"]["first_step"]
        for e in run.events()
        if e.get("attributes", {}).get("reason") == "requested" and e.get("rank") == PEER
    }
    times = _step_times(run, PEER)
    first = min(profiled)
    inside = [times[s] for s in range(first, first + PROFILE_STEPS) if s in times]
    before = [times[s] for s in range(first - 20, first) if s in times]
    after = [times[s] for s in range(first + PROFILE_STEPS + 1, first + PROFILE_STEPS + 21) if s in times]
    return {
        "before_s": statistics.median(before),
        "profiled_s": statistics.median(inside),
        "after_s": statistics.median(after),
    }


def hooks_cost_us(steps: int = 20_000) -> float:
    """The always-on part, per step: `profile_wanted()` + `collective()` + `step()` with step timings
    every 10 steps and profiling armed, as the reference job calls them (best of 5)."""
    best = float("inf")
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(5):
            hooks = MedicHooks(
                JOB, "node-a", 0, Path(folder) / "events.jsonl", world_size=2, timings_every=10
            )
            hooks.profile_on_demand(Path(folder) / "artifacts")
            began = time.perf_counter()
            for step in range(1, steps + 1):
                hooks.profile_wanted()
                hooks.collective()
                hooks.step(step, 1.0, 0.01)
            best = min(best, (time.perf_counter() - began) / steps * 1e6)
    return best


def run(runs: int = DEFAULT_RUNS, keep: Path | None = None) -> dict[str, Any]:
    """`runs` of each cause and the control; `keep`: a folder to keep each run's traces and logs in."""
    uptime_before = _uptime()
    with tempfile.TemporaryDirectory() as temporary:
        folder = keep or Path(temporary)
        results: list[dict[str, Any]] = []
        costs: list[dict[str, float]] = []
        for index in range(runs):
            for cause in EXPECTED:  # round robin: a change in the machine's load spreads over every cause
                pair = profile_pair(folder / f"{cause}-{index}", cause)
                diff = pair.diff()
                print(
                    f"bench.profile_diff: {cause} #{index}: {diff.cause} ({diff.reason})",
                    file=sys.stderr,
                    flush=True,
                )
                results.append(
                    {
                        "cause": cause,
                        "verdict": str(diff.cause),
                        "confidence": diff.confidence,
                        "where": diff.facts()["straggler_cause_where"],
                        "growth_ms": diff.evidence[0].growth_s * 1e3 if diff.evidence else 0.0,
                        "steps": len(diff.steps),
                        "peer_step_ms": (diff.peer_step_s or 0.0) * 1e3,
                        "seconds": pair.seconds,
                        "trace_kb": (pair.suspect.stat().st_size + pair.peer.stat().st_size) / 2 / 1024,
                    }
                )
                if cause == "none":
                    costs.append(_profile_cost(pair))
        timed = time.perf_counter()
        diagnose(pair.suspect, pair.peer)
        diff_s = time.perf_counter() - timed
    return {
        "runs": runs,
        "results": results,
        "costs": costs,
        "hooks_us": hooks_cost_us(),
        "diff_s": diff_s,
        "uptime_before": uptime_before,
        "uptime": _uptime(),
        "cpu": cpu_model(),
    }


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def section(results: dict[str, Any]) -> str:
    rows = results["results"]
    lines = [
        "## Why a rank is slow: its profile against a healthy peer's",
        "",
        f"The reference job under torchrun, 2 ranks on the CPU (gloo), rank 1 slowed by one cause "
        f"(`--inject-slow`, {INJECT_MS:g} ms a call, a batch or a step), both ranks profiled over the same "
        f"{PROFILE_STEPS} steps on request once warm, the traces diffed by `medic.profile_diff.diagnose` "
        f"(docs/culprit.md). {results['runs']} runs of each cause and of the control; machine: "
        f"{os.cpu_count()} cores, {results['cpu']}; `uptime` before: `{results['uptime_before']}`, after: "
        f"`{results['uptime']}`.",
        "",
        "| Injected on rank 1 | Expected | Runs | Right | Verdicts | Confidence (median) | Growth of the top entry (median) | Peer's profiled step (median) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cause, expected in EXPECTED.items():
        mine = [r for r in rows if r["cause"] == cause]
        right = sum(r["verdict"] == expected for r in mine)
        verdicts = ", ".join(f"{v} {n}" for v, n in Counter(r["verdict"] for r in mine).most_common())
        confidence = statistics.median(r["confidence"] for r in mine)
        growth = statistics.median(r["growth_ms"] for r in mine)
        step = statistics.median(r["peer_step_ms"] for r in mine)
        lines.append(
            f"| {cause} | `{expected}` | {len(mine)} | {right} | {verdicts} | {confidence:.2f} | "
            f"{growth:+.2f} ms | {step:.1f} ms |"
        )
    right = sum(r["verdict"] == EXPECTED[r["cause"]] for r in rows)
    software = [r for r in rows if EXPECTED[r["cause"]].software or r["cause"] == "none"]
    called_hardware = sum(Cause(r["verdict"]).hardware for r in software)
    named = Counter(r["where"] for r in rows if r["cause"] == "python" and r["verdict"] == "software-python")
    costs = results["costs"]
    before = statistics.median(c["before_s"] for c in costs)
    profiled = statistics.median(c["profiled_s"] for c in costs)
    after = statistics.median(c["after_s"] for c in costs)
    lines += [
        "",
        f"**Right cause: {right}/{len(rows)} = {right / len(rows):.0%}** (target ≥ 90%); software causes and "
        f"controls called hardware: **{called_hardware}** of {len(software)} (target 0). The Python function "
        f"named: {', '.join(f'`{w}` ({n})' for w, n in named.items()) or 'none'}.",
        "",
        f"**Cost.** The always-on part on the rank (`profile_wanted()` + `collective()` + `step()`, step "
        f"timings every 10 steps, profiling armed) costs {results['hooks_us']:.1f} µs a step (best of 5 runs of "
        f"20,000), {results['hooks_us'] / 1e6 / before:.3%} of the reference job's median step here "
        f"({before * 1e3:.1f} ms; ≤ 1% is the budget). A profiled pair: the peer's profiled steps take "
        f"{profiled * 1e3:.1f} ms (median, with shapes and Python stacks recorded) against {before * 1e3:.1f} ms "
        f"in the 20 steps before and {after * 1e3:.1f} ms in the 20 after, so the cost stays in the steps "
        f"profiled; a trace is {statistics.median(r['trace_kb'] for r in rows):.0f} kB "
        f"(median), and one diff takes {results['diff_s']:.1f} s. A run (launch, warm-up, the request's "
        f"5 s poll, profile, 40 steps after) took {statistics.median(r['seconds'] for r in rows):.0f} s.",
        "",
        "Reproduce: `PYTHONPATH=tests .venv/bin/python -m bench.profile_diff 10`.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    kept = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    print(section(run(int(sys.argv[1]) if len(sys.argv) > 1 else 10, kept)))
