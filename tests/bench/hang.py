"""Hang → named culprit before the watchdog, on the reference job under a real torchrun (4 ranks on
the CPU standing for 2 nodes), at the defaults: the job's stall watch at 30 s and the policy's
`stall_settle_seconds` 15.

- hung: rank 3 stops before step 12's collective (`--hang-rank 3 --hang-at-step 12`); the collective
  timeout is 300 s, so that nothing but the stalls can name it. The job's events file is read as it
  grows and pushed through the differential (medic/culprit.py) with the wall clock, its settle timer
  asked every 0.2 s as `medic serve`'s is. Measured: the hung rank's last progress (its stall
  report's time less its `stalled_s`) to the culprit's event coming out, which is when `medic serve`
  opens the incident (the rest of that path: the live path's section).
- clean: every rank slowed 50 times together (`--slow-all`, 1.5 s steps) under a 1 s stall watch, so
  that each step makes every rank report a stall at the same collective: hangs named must be 0.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.resume import job_command
from medic.culprit import Differential
from medic.events import FaultEvent
from medic.hangs import STALL_CHECK, STALL_SETTLE
from medic.integrations.processes import descendants, kill

RANKS = 4
NODES = "node-a,node-a,node-b,node-b"
HANG_RANK, HANG_AT = 3, 12
COLLECTIVE_TIMEOUT_S = 300
GIVE_UP_S = 150
TICK_S = 0.2


def _launch(workdir: Path, *args: str) -> subprocess.Popen[str]:
    command = [
        *job_command(workdir, RANKS),
        f"--artifacts={workdir / 'artifacts'}",
        f"--node-of-rank={NODES}",
        "--ckpt-every=1000",
        "--timings-every=5",
        "--step-work-s=0.03",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEDIC_STALL_DUMP_S", None)  # the job's default, unless a run names one
    log = (workdir / "torchrun.log").open("w")
    return subprocess.Popen(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _stop(process: subprocess.Popen[str]) -> None:
    for pid in [*descendants(process.pid), process.pid]:
        kill(pid)
    process.wait()


class _Tail:
    """The events file as it grows, through the differential, on the wall clock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.differential = Differential()
        self.stalls: list[FaultEvent] = []

    def poll(self) -> list[FaultEvent]:
        out: list[FaultEvent] = []
        if self.path.exists():
            with self.path.open() as handle:
                handle.seek(self.offset)
                text = handle.read()
            complete = text[: text.rfind("\n") + 1]
            self.offset += len(complete.encode())
            for line in complete.splitlines():
                event = FaultEvent.model_validate_json(line)
                if event.attributes.get("check") == STALL_CHECK:
                    self.stalls.append(event)
                out += self.differential.push(event)
        out += self.differential.due(datetime.now(UTC))
        return [e for e in out if e.attributes.get("detector") == "hang"]


def hung_run(workdir: Path) -> dict[str, float]:
    process = _launch(
        workdir,
        "--steps=40",
        f"--hang-rank={HANG_RANK}",
        f"--hang-at-step={HANG_AT}",
        f"--collective-timeout-s={COLLECTIVE_TIMEOUT_S}",
    )
    tail = _Tail(workdir / "events.jsonl")
    started = time.monotonic()
    try:
        while time.monotonic() - started < GIVE_UP_S:
            named = tail.poll()
            if named:
                out_at = datetime.now(UTC)
                break
            time.sleep(TICK_S)
        else:
            raise RuntimeError(f"no culprit within {GIVE_UP_S} s: {workdir}")
    finally:
        _stop(process)
    [culprit] = named
    assert (culprit.rank, culprit.node, culprit.attributes.get("before_timeout")) == (
        HANG_RANK,
        "node-b",
        True,
    )
    [own] = [e for e in tail.stalls if e.rank == HANG_RANK]
    onset = own.time.timestamp() - float(own.attributes["stalled_s"])
    first_stall = min(e.time for e in tail.stalls).timestamp()
    return {
        "hang_to_culprit_s": out_at.timestamp() - onset,
        "hang_to_first_stall_s": first_stall - onset,
        "first_stall_to_culprit_s": out_at.timestamp() - first_stall,
    }


def clean_run(workdir: Path) -> dict[str, int]:
    process = _launch(
        workdir, "--steps=20", "--slow-all", "--slow-factor=50", "--slow-from-step=1", "--stall-dump-s=1"
    )
    tail = _Tail(workdir / "events.jsonl")
    named: list[FaultEvent] = []
    try:
        while process.poll() is None:
            named += tail.poll()
            time.sleep(TICK_S)
        if process.returncode != 0:
            raise RuntimeError(f"the clean run failed ({process.returncode}): {workdir}")
        named += tail.poll() + tail.differential.flush()
    finally:
        _stop(process)
    return {
        "stalls": len(tail.stalls),
        "hangs_named": len([e for e in named if e.attributes.get("detector") == "hang"]),
    }


def _folder(root: str, name: str) -> Path:
    folder = Path(root) / name
    folder.mkdir()
    return folder


def run(hung: int = 5, clean: int = 5) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="medic-bench-hang-") as root:
        hangs = [hung_run(_folder(root, f"hung-{i}")) for i in range(hung)]
        cleans = [clean_run(_folder(root, f"clean-{i}")) for i in range(clean)]
    load = os.getloadavg()
    return {"hung": hangs, "clean": cleans, "load": load, "stall_settle_s": STALL_SETTLE.total_seconds()}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s ({min(values):.1f} to {max(values):.1f})"


def section(results: dict[str, Any]) -> str:
    hung, clean = results["hung"], results["clean"]
    rows = [
        (
            "the hung rank's last progress → the first stall report (the job's 30 s watch, waking every 7.5 s)",
            "hang_to_first_stall_s",
        ),
        (
            f"first stall report → culprit named (`stall_settle_seconds` {results['stall_settle_s']:g})",
            "first_stall_to_culprit_s",
        ),
        ("**hang → culprit named, the incident opened**", "hang_to_culprit_s"),
    ]
    table = "\n".join(f"| {label} | {_spread([r[key] for r in hung])} |" for label, key in rows)
    stalls = sum(c["stalls"] for c in clean)
    false = sum(c["hangs_named"] for c in clean)
    return (
        "## Hangs named before the watchdog\n\n"
        f"{__doc__.split(chr(10) + chr(10), 1)[1].strip()}\n\n"
        f"| {len(hung)} hung runs | median (min to max) |\n| --- | --- |\n{table}\n\n"
        f"Clean runs: {len(clean)}, {stalls} stall reports, **{false} hangs named**. "
        f"Load average at the end: {results['load'][0]:.1f}.\n"
    )


if __name__ == "__main__":
    print(
        section(
            run(int(sys.argv[1]) if len(sys.argv) > 1 else 5, int(sys.argv[2]) if len(sys.argv) > 2 else 5)
        )
    )
