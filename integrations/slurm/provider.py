"""A `NodeProvider` that asks Slurm to reboot nodes, or hands nodes to SageMaker HyperPod's repair
agent through HyperPod's Slurm convention.

Conventions (`convention=`, env MEDIC_SLURM_ACTIONS):
- "scontrol" (default): reboot → `scontrol reboot reason="medic: ..." NODE`, run by slurmd's
  RebootProgram once the node is idle. The node keeps its state across the reboot: drained before,
  drained after (measured on 22.05), so a node GPU Medic drained stays out until verification resumes
  it. `resume_after_reboot=True` uses `scontrol reboot ASAP nextstate=RESUME` instead: Slurm itself
  returns the node to service when it is back, before any verification. Slurm has no GPU reset, so
  reset_gpu reboots the node (resetting every GPU) and says so; Slurm cannot replace hardware, so
  replace raises UnsupportedSlurmActionError (a SlurmError) and the incident goes to a human.
- "hyperpod": reboot and reset_gpu → `scontrol update nodename=N state=fail reason="Action:Reboot"`,
  replace → `reason="Action:Replace"`; HyperPod's agent does the work and returns the node to service
  itself. The reason no longer starts with "medic:", so GPU Medic will not resume the node.
A node out of service for someone else's reason (an admin's drain, Slurm's "Not responding") is never
touched: NodeHeldByOthersError.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Literal, cast, get_args

from integrations.polling import poll
from integrations.slurm.cli import SlurmCli
from integrations.slurm.errors import NodeHeldByOthersError, UnsupportedSlurmActionError
from integrations.slurm.records import MEDIC_PREFIX, SlurmNode, is_ours

Convention = Literal["scontrol", "hyperpod"]
CONVENTION_VAR = "MEDIC_SLURM_ACTIONS"

# While any of these is set the node is still on its way back (or, FAIL, still in HyperPod's hands).
_IN_PROGRESS = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED", "NOT_RESPONDING", "FAIL", "POWERING_UP"})


class SlurmRebootProvider:
    def __init__(
        self,
        cli: SlurmCli | None = None,
        *,
        convention: Convention = "scontrol",
        resume_after_reboot: bool = False,
        poll_interval_s: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if convention not in get_args(Convention):
            raise ValueError(
                f"unknown Slurm action convention {convention!r} ({CONVENTION_VAR}); "
                f"use one of {', '.join(get_args(Convention))}"
            )
        self.cli = cli or SlurmCli()
        self.convention = convention
        self.resume_after_reboot = resume_after_reboot
        self.poll_interval_s = poll_interval_s
        self._sleep = sleep
        self._clock = clock

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmRebootProvider:
        env = os.environ if env is None else env
        convention = cast(Convention, env.get(CONVENTION_VAR, "scontrol"))  # checked in __init__
        return cls(SlurmCli.from_env(env), convention=convention)

    def _ours_to_act_on(self, name: str, action: str) -> SlurmNode:
        node = self.cli.node(name)
        if node.held_by_others:
            raise NodeHeldByOthersError(name, node.describe, node.reason, action)
        return node

    def _hyperpod(self, name: str, action: Literal["Reboot", "Replace"]) -> str:
        self._ours_to_act_on(name, action.lower())
        self.cli.scontrol("update", f"nodename={name}", "state=fail", f"reason=Action:{action}")
        return f"asked HyperPod to {action.lower()} {name} (Slurm state=fail, reason Action:{action})"

    def _scontrol_reboot(self, name: str, why: str) -> str:
        node = self._ours_to_act_on(name, "reboot")
        # scontrol reboot replaces the node's reason: keep ours, which names the incident.
        reason = node.reason if is_ours(node.reason) else f"{MEDIC_PREFIX} {why}"
        if self.resume_after_reboot:
            self.cli.scontrol("reboot", "ASAP", "nextstate=RESUME", f"reason={reason}", name)
            return f"asked Slurm to reboot {name} as soon as it is idle, then return it to service"
        self.cli.scontrol("reboot", f"reason={reason}", name)
        return f"asked Slurm to reboot {name} once idle; it stays {node.state.value} afterwards"

    def reboot(self, node: str) -> str:
        if self.convention == "hyperpod":
            return self._hyperpod(node, "Reboot")
        return self._scontrol_reboot(node, "reboot")

    def reset_gpu(self, node: str, gpu: int | None) -> str:
        which = "all GPUs" if gpu is None else f"GPU {gpu}"
        if self.convention == "hyperpod":
            done = self._hyperpod(node, "Reboot")
        else:
            done = self._scontrol_reboot(node, f"reboot to reset {which}")
        return f"no GPU reset through Slurm: a reboot resets {which}; {done}"

    def replace(self, node: str) -> str:
        if self.convention == "hyperpod":
            return self._hyperpod(node, "Replace")
        raise UnsupportedSlurmActionError(
            f"{node}: Slurm cannot replace hardware; use the HyperPod convention "
            f"({CONVENTION_VAR}=hyperpod) or a cloud provider, or replace it by hand"
        )

    def _settled(self, name: str) -> bool | None:
        node = self.cli.node(name)
        if node.flags & _IN_PROGRESS:
            return None
        if node.base in ("down", "error"):
            # After our reboot, down without a reboot flag means it failed ("reboot timed out");
            # HyperPod may take a node down on its way through repair, so keep waiting there.
            return None if self.convention == "hyperpod" else False
        return True

    def wait_ready(self, node: str, timeout_s: float) -> bool:
        """True once the node is back and answering (drained or not); False if it failed or time ran out."""
        return bool(
            poll(lambda: self._settled(node), timeout_s, self.poll_interval_s, self._sleep, self._clock)
        )
