"""A named straggler carries why it is slow: the reference job under a real torchrun (3 ranks on the
CPU, gloo, standing for 2 nodes), rank 1 busy in a Python function, its events read as `medic serve`
reads them, through the intake differential (medic/culprit.py). The peer detector names rank 1; the
request files for it and a healthy peer are written as the live path writes them (medic/flows/live.py), the
two ranks profile the same steps, the traces are diffed, and the next straggler carries the verdict.

Three ranks: with two, neither stands out against "the others" (medic/peers.py needs two peers and
fewer than half the ranks named). The diff's accuracy over many runs is in BENCHMARKS.md
(tests/bench/profile_diff.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from bench.resume import job_command

from medic.culprit import Differential
from medic.events import EventKind, FaultEvent
from medic.flows.job_signals import ask_and_diagnose
from medic.integrations.processes import descendants, kill
from medic.pair_profiles import PAIR_STEPS
from medic.profiles import PROFILE_CHECK

pytestmark = pytest.mark.system

SUSPECT, PEER = 1, 0  # rank 1 on node-b with rank 2; rank 0 alone on node-a: the peer elsewhere
GIVE_UP_S = 150  # launch ~7 s, the pair's lead 15 s, the profiles and a diff: ~35 s on 2 cores


def new_events(path: Path, offset: int) -> tuple[list[FaultEvent], int]:
    """The complete lines written since `offset` (three ranks append to the file as they go)."""
    if not path.exists():
        return [], offset
    with path.open("rb") as sink:
        sink.seek(offset)
        text = sink.read()
    whole = text[: text.rfind(b"\n") + 1]
    return [FaultEvent.model_validate_json(line) for line in whole.splitlines()], offset + len(whole)


def serve(workdir: Path, job: subprocess.Popen[str]) -> tuple[FaultEvent, list[FaultEvent]]:
    """Read the job's events as they come, as the live path does, until a straggler carries a cause:
    that straggler and every event read."""
    differential = Differential(ask_profiles=True)
    offset, seen = 0, []
    began = time.monotonic()
    while time.monotonic() - began < GIVE_UP_S and job.poll() is None:
        events, offset = new_events(workdir / "events.jsonl", offset)
        seen += events
        for event in events:
            for out in differential.push(event):
                if out.kind is EventKind.STRAGGLER and "straggler_cause" in out.attributes:
                    return out, seen
        ask_and_diagnose(differential, workdir)
        time.sleep(0.2)
    raise AssertionError(f"no straggler with a cause in {workdir} (see torchrun.log)")


def test_the_straggler_of_a_python_hot_spot_is_said_to_be_software(tmp_path: Path) -> None:
    command = [
        *job_command(tmp_path, 3),
        f"--artifacts={tmp_path / 'artifacts'}",
        "--steps=100000",  # stopped once the verdict is out
        "--ckpt-every=100000",
        "--stall-dump-s=0",
        "--timings-every=10",
        "--node-of-rank=node-a,node-b,node-b",
        "--batch-size=48",  # split evenly over the 3 ranks
        "--inject-slow=python",
        f"--inject-rank={SUSPECT}",
        "--inject-ms=5",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_DEVICE": "cpu"}
    with (tmp_path / "torchrun.log").open("w") as log:
        job = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
    try:
        straggler, seen = serve(tmp_path, job)
    finally:
        for pid in [*descendants(job.pid), job.pid]:
            kill(pid)
        job.wait()
    assert (straggler.rank, straggler.node) == (SUSPECT, "node-b")
    attributes = straggler.attributes
    assert attributes["straggler_cause"] == "software-python", attributes.get("straggler_cause_reason")
    assert attributes["straggler_cause_hardware"] is False
    assert "injected_hot_spot" in attributes["straggler_cause_where"]
    assert attributes["straggler_cause_evidence"][0]["category"] == "python"
    # The pair: the suspect's own trace and the peer's on the other node, of the very same steps.
    asked = {
        e.rank: e
        for e in seen
        if e.attributes.get("check") == PROFILE_CHECK and e.attributes.get("reason") == "requested"
    }
    assert asked.keys() == {SUSPECT, PEER}
    assert attributes["artifact"] == asked[SUSPECT].attributes["artifact"]
    assert attributes["straggler_cause_peer_artifact"] == asked[PEER].attributes["artifact"]
    first, last = ({e.attributes[k] for e in asked.values()} for k in ("first_step", "last_step"))
    assert len(first) == len(last) == 1 and last.pop() - first.pop() + 1 == PAIR_STEPS
