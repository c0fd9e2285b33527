"""`GpuReset` with `nvidia-smi --gpu-reset` on the node, through the runner DCGM uses (local, srun or
ssh; medic/integrations/dcgm/runner.py). The node is drained and its jobs are off before this is called.

NVIDIA's preconditions (nvidia-smi's help and manual), each checked or met before the reset:
- No process may use the GPU. The compute processes are read first: one still there (a crashed job's
  context the driver has not let go) would have the reset refused, so the node is rebooted instead.
- Persistence mode holds the device open like a client: it is turned off for the reset and back on
  after, only where it was on (the refusal it causes is recorded in tests/fixtures/nvidia_smi/).
- Scope. From Hopper (compute capability 9.0) a GPU is reset on its own, NVSwitch or not. Before it,
  GPUs joined by NVLink must be reset together, and on Ampere NVSwitch systems only Fabric Manager
  makes a single reset possible: there, and wherever the capability cannot be read, every GPU of the
  node is reset (nvidia-smi without `-i`, which NVIDIA documents as always sufficient). The node is
  drained and empty, so the wider reset costs nothing.

The outcome is read from what nvidia-smi prints: `GPU <bus id> was successfully reset.` for every GPU
asked for, and exit 0. Anything else ("The following GPUs could not be reset:", a text we do not know,
no answer in time) is not done. Then every GPU reset must answer again with its bus id: one that does
not is not done either. "Not done" is never raised: the act stage reboots the node and says why.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from medic.integrations.dcgm.diagnostics import NODE_NAME
from medic.integrations.dcgm.runner import (
    Completed,
    NodeRunner,
    RunnerConfigError,
    SrunRunner,
    runner_from_env,
)
from medic.protocols import GpuResetOutcome

QUERY_S = 30.0
RESET_S = 120.0  # an FLR takes seconds; a reset that hangs on a wedged GPU is given up on
# Hopper: the first architecture whose NVLink GPUs reset one by one without Fabric Manager.
SINGLE_GPU_RESET_FROM = (9, 0)

GPUS = ("--query-gpu=index,pci.bus_id,compute_cap,persistence_mode", "--format=csv,noheader")
PROCESSES = ("--query-compute-apps=pid,process_name,gpu_bus_id,used_memory", "--format=csv,noheader")
_BUS_ID = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]$")
_CAPABILITY = re.compile(r"^(\d+)\.(\d+)$")
_RESET = re.compile(r"^GPU (\S+) was successfully reset\.$")
_NOT_RESET = re.compile(r"^\s+GPU (\S+): (.+)$")


class UnreadableOutputError(ValueError):
    """nvidia-smi printed what we cannot read: nothing is decided from it."""


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    bus_id: str  # upper case: nvidia-smi prints it so, and it is compared across commands
    capability: tuple[int, int] | None  # None: nvidia-smi did not give one ([N/A], an old driver)
    persistence: bool | None


@dataclass(frozen=True, slots=True)
class Process:
    pid: int
    name: str
    bus_id: str


def parse_gpus(text: str) -> list[Gpu]:
    """`0, 00000000:00:06.0, 9.0, Enabled` per GPU (GPUS); UnreadableOutputError for anything else."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4 or not fields[0].isdigit() or not _BUS_ID.match(fields[1]):
            raise UnreadableOutputError(f"not a GPU line: {line.strip()!r}")
        capability = _CAPABILITY.match(fields[2])
        persistence = {"Enabled": True, "Disabled": False}.get(fields[3])
        gpus.append(
            Gpu(
                int(fields[0]),
                fields[1].upper(),
                (int(capability[1]), int(capability[2])) if capability else None,
                persistence,
            )
        )
    if not gpus:
        raise UnreadableOutputError("no GPU listed")
    return gpus


def parse_processes(text: str) -> list[Process]:
    """`561, python3, 00000000:00:06.0, 630 MiB` per compute process (PROCESSES); nothing when none
    runs. A process name may hold commas: the pid is the first field, the bus id the last but one."""
    found = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit() or not _BUS_ID.match(fields[-2]):
            raise UnreadableOutputError(f"not a process line: {line.strip()!r}")
        found.append(Process(int(fields[0]), ", ".join(fields[1:-2]), fields[-2].upper()))
    return found


@dataclass(frozen=True, slots=True)
class ResetAnswer:
    reset: frozenset[str]  # bus ids nvidia-smi says it reset
    refused: dict[str, str]  # bus id -> why nvidia-smi did not reset it


def parse_reset(text: str) -> ResetAnswer:
    reset = {m[1].upper() for line in text.splitlines() if (m := _RESET.match(line.strip()))}
    refused = {m[1].upper(): m[2].strip() for line in text.splitlines() if (m := _NOT_RESET.match(line))}
    return ResetAnswer(frozenset(reset), refused)


def scope(gpus: Sequence[Gpu], gpu: int | None) -> tuple[list[Gpu], str | None]:
    """The GPUs to reset for `gpu` (None: all), and why more than the one asked for, if so."""
    if gpu is None:
        return list(gpus), None
    target = next((g for g in gpus if g.index == gpu), None)
    if target is None:
        raise LookupError(f"no GPU {gpu} (the node lists {', '.join(str(g.index) for g in gpus)})")
    if len(gpus) == 1 or (target.capability is not None and target.capability >= SINGLE_GPU_RESET_FROM):
        return [target], None
    if target.capability is None:
        return list(gpus), "its compute capability is not reported, so every GPU is reset together"
    major, minor = target.capability
    return list(gpus), (f"compute capability {major}.{minor}: before Hopper, NVLink peers are reset together")


def _named(gpus: Sequence[Gpu]) -> str:
    if len(gpus) == 1:
        return f"GPU {gpus[0].index} ({gpus[0].bus_id})"
    return f"GPUs {','.join(str(g.index) for g in gpus)}"


class NvidiaSmiGpuReset:
    def __init__(
        self, runner: NodeRunner, nvidia_smi: str = "nvidia-smi", reset_timeout_s: float = RESET_S
    ) -> None:
        self.runner = runner
        self.nvidia_smi = nvidia_smi
        self.reset_timeout_s = reset_timeout_s

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NvidiaSmiGpuReset:
        """The runner DCGM uses (MEDIC_DCGM_RUNNER & co); MEDIC_NVIDIA_SMI: nvidia-smi's path on the nodes.
        Not srun: Slurm allocates nothing on a drained node, and a GPU is reset only on one."""
        runner = runner_from_env(env)
        if isinstance(runner, SrunRunner):
            raise RunnerConfigError(
                "MEDIC_DCGM_RUNNER=srun cannot reach a drained node, and a GPU is reset only on one: "
                "use ssh or local"
            )
        return cls(runner, nvidia_smi=env.get("MEDIC_NVIDIA_SMI") or "nvidia-smi")

    def _run(self, node: str, args: Sequence[str], timeout_s: float = QUERY_S) -> Completed:
        return self.runner.run(node, (self.nvidia_smi, *args), timeout_s)

    def _read(self, node: str, what: str, args: Sequence[str]) -> str:
        done = self._run(node, args)
        why = done.failure(f"{what} on {node}", QUERY_S)
        if why:
            raise UnreadableOutputError(why)
        return done.stdout

    def reset(self, node: str, gpu: int | None) -> GpuResetOutcome:
        if not NODE_NAME.match(node):
            return GpuResetOutcome(False, f"{node!r} is not a node name we pass to a runner")
        try:
            gpus = parse_gpus(self._read(node, "reading the GPUs", GPUS))
            chosen, wider = scope(gpus, gpu)
            processes = parse_processes(self._read(node, "reading the GPUs' processes", PROCESSES))
        except (UnreadableOutputError, LookupError) as error:
            return GpuResetOutcome(False, f"not reset: {error}")
        indices = tuple(g.index for g in chosen)
        buses = {g.bus_id: g for g in chosen}
        holding = [p for p in processes if p.bus_id in buses]
        if holding:
            held = "; ".join(f"pid {p.pid} ({p.name}) holds GPU {buses[p.bus_id].index}" for p in holding)
            return GpuResetOutcome(False, f"not reset: {held} on {node}", indices)
        persistent = [g for g in chosen if g.persistence]
        ids = ",".join(str(g.index) for g in persistent)
        if persistent:
            off = self._run(node, ("-pm", "0", "-i", ids))
            why = off.failure("turning persistence mode off", QUERY_S)
            if why:
                return GpuResetOutcome(False, f"not reset: {why}", indices)
        try:
            outcome = self._reset(node, chosen, wider)
        finally:
            restored = self._run(node, ("-pm", "1", "-i", ids)) if persistent else None
        if restored is not None:
            why = restored.failure("turning persistence mode back on", QUERY_S)
            note = f"; {why}" if why else "; persistence mode turned off for it and back on"
            outcome = GpuResetOutcome(outcome.done, outcome.detail + note, outcome.gpus)
        return outcome

    def _reset(self, node: str, chosen: list[Gpu], wider: str | None) -> GpuResetOutcome:
        indices = tuple(g.index for g in chosen)
        # More than one is every GPU of the node: without -i, as NVIDIA documents for a reset that
        # must take the NVLink peers along.
        target = () if len(chosen) > 1 else ("-i", str(chosen[0].index))
        started = time.monotonic()
        done = self._run(node, ("--gpu-reset", *target), self.reset_timeout_s)
        took = time.monotonic() - started
        answer = parse_reset(done.stdout + "\n" + done.stderr)
        named = _named(chosen)
        why = done.failure(f"nvidia-smi --gpu-reset on {node}", self.reset_timeout_s)
        missing = [g for g in chosen if g.bus_id not in answer.reset]
        if why or missing:
            said = "; ".join(f"{bus}: {reason}" for bus, reason in answer.refused.items())
            unconfirmed = f"no success line for {_named(missing)}" if missing else ""
            return GpuResetOutcome(
                False, f"{named} not reset: {'; '.join(p for p in (why, said, unconfirmed) if p)}", indices
            )
        try:
            after = {
                g.bus_id: g for g in parse_gpus(self._read(node, "reading the GPUs after the reset", GPUS))
            }
        except UnreadableOutputError as error:
            return GpuResetOutcome(False, f"{named} reset, but not seen answering again: {error}", indices)
        gone = [g for g in chosen if g.bus_id not in after]
        if gone:
            return GpuResetOutcome(False, f"{named} reset, but {_named(gone)} no longer listed", indices)
        because = f" ({wider})" if wider else ""
        return GpuResetOutcome(
            True, f"reset {named} on {node} with nvidia-smi in {took:.1f} s{because}", indices
        )
