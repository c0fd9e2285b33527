"""Launching the reference training job (medic/training/train.py) under a real torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from medic.events import FaultEvent
from medic.integrations.processes import descendants, free_port, kill
from medic.shipped import TRAIN_SCRIPT

TRAINING_DIR = TRAIN_SCRIPT.parent
LAUNCH_TIMEOUT_S = 120  # a launch takes 5-7 s on 2 cores; the rest is headroom for a loaded machine


@dataclass(frozen=True, slots=True)
class Run:
    returncode: int
    output: str
    ckpt_dir: Path
    loss_log: Path
    events: Path

    def losses(self) -> dict[tuple[int, int], str]:
        """(step, rank) -> the loss as float.hex(), for bit-exact comparison."""
        if not self.loss_log.exists():
            return {}
        lines = (json.loads(line) for line in self.loss_log.read_text().splitlines())
        return {(line["step"], line["rank"]): line["loss"] for line in lines}

    def fault_events(self) -> list[FaultEvent]:
        if not self.events.exists():
            return []
        return [FaultEvent.model_validate_json(line) for line in self.events.read_text().splitlines()]


def kill_tree(process: subprocess.Popen[str]) -> None:
    for pid in [*descendants(process.pid), process.pid]:
        kill(pid)
    process.wait()


def launch(
    workdir: Path,
    ranks: int,
    *args: str,
    ckpt_dir: Path | None = None,
    launcher_args: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[str], Run]:
    """Start the job; the loss log and events land in `workdir` (the Run's returncode is not known yet)."""
    workdir.mkdir(parents=True, exist_ok=True)
    run = Run(
        returncode=-1,
        output="",
        ckpt_dir=ckpt_dir or workdir / "checkpoints",
        loss_log=workdir / "losses.jsonl",
        events=workdir / "events.jsonl",
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        *launcher_args,
        str(TRAIN_SCRIPT),
        f"--ckpt-dir={run.ckpt_dir}",
        f"--loss-log={run.loss_log}",
        f"--events={run.events}",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # also silences torchrun's banner about it
    process = subprocess.Popen(
        command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return process, run


def torchrun(
    workdir: Path,
    ranks: int,
    *args: str,
    ckpt_dir: Path | None = None,
    launcher_args: tuple[str, ...] = (),
) -> Run:
    """Run the job to its end (or its failure); the loss log and events land in `workdir`."""
    process, run = launch(workdir, ranks, *args, ckpt_dir=ckpt_dir, launcher_args=launcher_args)
    try:
        output, _ = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        raise
    (workdir / "torchrun.log").write_text(output)  # kept for a failed assertion's post-mortem
    return replace(run, returncode=process.returncode, output=output)
