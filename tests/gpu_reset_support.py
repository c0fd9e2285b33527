"""A GPU node's `nvidia-smi` for the GPU reset's tests: a program that answers each command with what
nvidia-smi printed on real machines (tests/fixtures/nvidia_smi/SOURCES.md) and logs what it was asked,
run through the real runners as the real one is."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

from checkout import TEST_FIXTURES

from medic.integrations.dcgm.runner import LocalRunner
from medic.integrations.gpu_reset import GPUS, PROCESSES, Gpu, NvidiaSmiGpuReset

FIXTURES = TEST_FIXTURES / "nvidia_smi"
H200 = (FIXTURES / "h200-query-gpu.csv").read_text()
IDLE = (FIXTURES / "h200-compute-apps-idle.csv").read_text()
BUSY = (FIXTURES / "h200-compute-apps-busy.csv").read_text()
SUCCEEDED = (FIXTURES / "reset-succeeded.txt").read_text()
IN_USE = (FIXTURES / "reset-in-use.txt").read_text()
NVSENTINEL_BUS = "00000000:1A:00.0"  # the GPU NVSentinel's recordings reset
# The recorded 8 x H100 node's bus ids (tests/fixtures/nvml/h100-sxm-x8-565.57.01.txt).
H100_BUSES = [f"00000000:{b}:00.0" for b in ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")]
NODE = "localhost"

FAKE = """\
import json, pathlib, sys
here = pathlib.Path(sys.argv[0]).parent
args = " ".join(sys.argv[1:])
with open(here / "calls.log", "a") as log:
    log.write(args + "\\n")
answers = json.loads((here / "answers.json").read_text())
queue = answers[args]
out, rc = queue.pop(0) if len(queue) > 1 else queue[0]
(here / "answers.json").write_text(json.dumps(answers))
sys.stdout.write(out)
sys.exit(rc)
"""


def line(gpu: Gpu) -> str:
    """A GPU in the recorded `--query-gpu` line's format."""
    capability = "[N/A]" if gpu.capability is None else ".".join(map(str, gpu.capability))
    return f"{gpu.index}, {gpu.bus_id}, {capability}, {'Enabled' if gpu.persistence else 'Disabled'}\n"


def eight_gpus(capability: tuple[int, int] | None) -> str:
    return "".join(line(Gpu(i, bus, capability, True)) for i, bus in enumerate(H100_BUSES))


def succeeded(buses: list[str]) -> str:
    """NVSentinel's recorded success line, once per GPU."""
    return "".join(SUCCEEDED.replace(NVSENTINEL_BUS, bus) for bus in buses)


class Node:
    """This machine as a GPU node (by `names` too): an `nvidia-smi` in `folder`, answering from
    `answers`."""

    def __init__(self, folder: Path, names: tuple[str, ...] = ()) -> None:
        self.folder = folder
        self.names = names
        program = folder / "nvidia-smi"
        program.write_text(f"#!{sys.executable}\n{FAKE}")
        program.chmod(program.stat().st_mode | stat.S_IXUSR)

    def answer(self, answers: dict[tuple[str, ...], list[tuple[str, int]]]) -> None:
        (self.folder / "answers.json").write_text(json.dumps({" ".join(k): v for k, v in answers.items()}))

    def calls(self) -> list[str]:
        log = self.folder / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def resetter(self) -> NvidiaSmiGpuReset:
        return NvidiaSmiGpuReset(LocalRunner(aliases=self.names), nvidia_smi=str(self.folder / "nvidia-smi"))


def hopper(bus: str = NVSENTINEL_BUS, persistence: bool = True) -> str:
    return line(Gpu(0, bus, (9, 0), persistence))


def hopper_node(reset: tuple[str, int]) -> dict[tuple[str, ...], list[tuple[str, int]]]:
    """One idle Hopper GPU with persistence mode on, whose reset answers `reset`."""
    return {
        GPUS: [(hopper(), 0)],
        PROCESSES: [(IDLE, 0)],
        ("-pm", "0", "-i", "0"): [("", 0)],
        ("--gpu-reset", "-i", "0"): [reset],
        ("-pm", "1", "-i", "0"): [("", 0)],
    }
