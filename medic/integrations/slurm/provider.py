"""A `NodeProvider` that asks Slurm to reboot nodes, or hands nodes to SageMaker HyperPod's repair
agent through HyperPod's Slurm convention.

Conventions (`convention=`, env MEDIC_SLURM_ACTIONS):
- "scontrol" (default): reboot → `scontrol reboot reason="medic: ..." NODE`, run by slurmd's
  RebootProgram once the node is idle. The node keeps its state across the reboot: drained before,
  drained after (measured on 22.05), so a node GPU Medic drained stays out until verification resumes
  it. `resume_after_reboot=True` uses `scontrol reboot ASAP nextstate=RESUME` instead: Slurm itself
  returns the node to service when it is back, before any verification. Slurm has no GPU reset, so
  reset_gpu reboots the node (resetting every GPU) and says so, unless a GPU reset in place is
  configured beside it (MEDIC_GPU_RESET=nvidia-smi, docs/gpu-reset.md), which then calls only reboot; Slurm cannot replace hardware, so
  replace raises UnsupportedSlurmActionError (a SlurmError) and the incident goes to a human.
- "hyperpod": reboot and reset_gpu → `scontrol update nodename=N state=fail reason="Action:Reboot"`,
  replace → `reason="Action:Replace"`; HyperPod's agent does the work and returns the node to service
  itself. The reason no longer starts with "medic:", so GPU Medic will not resume the node.
A node out of service for someone else's reason (an admin's drain, Slurm's "Not responding") is never
touched: NodeHeldByOthersError.

Readiness is proven by the node's BootTime (slurmd reports it when it registers): each reboot or
replacement records the BootTime Slurm shows at the request, and `wait_ready` answers True only once
Slurm shows a later one (by more than BOOT_SLACK_S, above the second-granularity jitter of a
re-registration) with no reboot under way and the node not down. A node that never reboots, or never
comes back, ends in NodeNotBackError at the timeout. A BootTime that cannot be read stops the action
before it is requested (UnreadableSlurmDataError): an outcome that could not be proven is not started.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Literal, cast, get_args

from medic.integrations.polling import Comeback, poll, wait_back
from medic.integrations.settling import booted_since, not_booted
from medic.integrations.slurm.cli import SlurmCli
from medic.integrations.slurm.errors import NodeHeldByOthersError, UnsupportedSlurmActionError
from medic.integrations.slurm.records import MEDIC_PREFIX, SlurmNode, is_ours
from medic.protocols import Settled

Convention = Literal["scontrol", "hyperpod"]
CONVENTION_VAR = "MEDIC_SLURM_ACTIONS"

# While any of these is set the node is still on its way back (or, FAIL, still in HyperPod's hands).
_IN_PROGRESS = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED", "NOT_RESPONDING", "FAIL", "POWERING_UP"})
# slurmd derives BootTime from its uptime at each registration, in whole seconds: a re-registration
# without a reboot may move it by a second. A reboot moves it by at least the time since the last boot.
BOOT_SLACK_S = 2


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
        # Node → (the action awaiting proof, the BootTime Slurm showed when it was requested).
        self._requested: dict[str, tuple[Comeback, int | None]] = {}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmRebootProvider:
        env = os.environ if env is None else env
        convention = cast(Convention, env.get(CONVENTION_VAR, "scontrol"))  # checked in __init__
        return cls(SlurmCli.from_env(env), convention=convention)

    def _ours_to_act_on(self, name: str, action: str) -> SlurmNode:
        """The node, if it is ours to act on; its BootTime is recorded as the marker `wait_ready` needs."""
        node, booted = self.cli.node_and_boot(name)
        if node.held_by_others:
            raise NodeHeldByOthersError(name, node.describe, node.reason, action)
        what = "replace" if action == "replace" else "reboot"
        self._requested[name] = (Comeback(name, what, f"{node.describe}, BootTime {_when(booted)}"), booted)
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
        return self._state_verdict(self.cli.node(name))

    def _state_verdict(self, node: SlurmNode) -> bool | None:
        if node.flags & _IN_PROGRESS:
            return None
        if node.base in ("down", "error"):
            # After our reboot, down without a reboot flag means it failed ("reboot timed out");
            # HyperPod may take a node down on its way through repair, so keep waiting there.
            return None if self.convention == "hyperpod" else False
        return True

    def _back(self, comeback: Comeback, before: int | None) -> bool | None:
        node, booted = self.cli.node_and_boot(comeback.node)
        comeback.last_seen = f"{node.describe}, BootTime {_when(booted)}"
        if booted is not None and (before is None or booted - before > BOOT_SLACK_S):
            comeback.went_away = True
        verdict = self._state_verdict(node)
        if verdict is True and not comeback.went_away:
            return None  # answering, but on the boot it had before the request: it never left
        return verdict

    def booted_at(self, node: str) -> datetime | None:
        return self.cli.booted_at(node)

    def settle(self, node: str, action: str, since: datetime) -> Settled | None:
        """Slurm's own record: a BootTime at or after `since` (done), the request still under way in
        Slurm, a reboot flag or HyperPod's `Action:` reason (done: it was accepted), or neither
        with an earlier BootTime (not done: `scontrol` flags the node before it returns)."""
        found, booted = self.cli.node_and_boot(node)
        when = None if booted is None else datetime.fromtimestamp(booted, UTC)
        proven = booted_since(node, when, since)
        if proven is not None:
            return proven
        if found.flags & _IN_PROGRESS or (found.reason or "").startswith("Action:"):
            return Settled(True, f"{node} has it under way in Slurm ({found.describe})")
        return None if when is None else not_booted(node, when)

    def wait_ready(self, node: str, timeout_s: float) -> bool:
        """After a reboot or replacement requested through this provider: True once Slurm shows a BootTime
        later than the one recorded at the request and the node is answering again (drained or not);
        False if it came back down (scontrol convention: the reboot failed); NodeNotBackError if that was
        not seen within `timeout_s`. With nothing requested here there is nothing to prove: True when the
        node is up now, False when it is down or time ran out."""
        requested = self._requested.get(node)
        if requested is None:
            return bool(
                poll(lambda: self._settled(node), timeout_s, self.poll_interval_s, self._sleep, self._clock)
            )
        comeback, before = requested
        ready = wait_back(
            comeback,
            lambda c: self._back(c, before),
            timeout_s,
            self.poll_interval_s,
            self._sleep,
            self._clock,
        )
        if ready:
            del self._requested[node]
        return ready


def _when(epoch: int | None) -> str:
    return "none" if epoch is None else datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
