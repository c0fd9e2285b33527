"""`InstanceProbe` from NVML on the node itself: `python3 -m medic.integrations.nvml` run there.

NVML answers only on the machine whose GPUs it drives, so the probe runs GPU Medic's own reader on
the node (installed there for `medic agent`), through the same runner as DCGM (ssh, srun or local;
medic/integrations/dcgm/runner.py), and reads the snapshot it prints: GPUs enumerated
(nvmlDeviceGetCount), which answer, and each one's NVLink state per link (nvmlDeviceGetNvLinkState).
A run that does not end in a snapshot is an `error` reading, never a healthy one.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from medic.integrations.dcgm.diagnostics import NODE_NAME
from medic.integrations.dcgm.runner import NodeRunner, runner_from_env
from medic.protocols import GpuReading, InstanceReading


class NvmlProbe:
    def __init__(self, runner: NodeRunner, python: str = "python3") -> None:
        self.runner = runner
        self.python = python

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NvmlProbe:
        """The runner DCGM uses (MEDIC_DCGM_RUNNER & co); MEDIC_NODE_PYTHON: the node's Python with
        GPU Medic installed (default python3)."""
        return cls(runner_from_env(env), env.get("MEDIC_NODE_PYTHON") or "python3")

    def command(self) -> list[str]:
        return [self.python, "-m", "medic.integrations.nvml"]

    def read(self, node: str, timeout_s: float) -> InstanceReading:
        started = datetime.now(UTC)

        def unread(why: str, output: str = "") -> InstanceReading:
            return InstanceReading(
                node, error=why, output=output, started_at=started, finished_at=datetime.now(UTC)
            )

        if not NODE_NAME.fullmatch(node):
            return unread(f"{node!r} is not a node name a command can be sent to")
        done = self.runner.run(node, self.command(), timeout_s)
        command = shlex.join(done.argv)
        output = done.stdout + (f"\n{done.stderr}" if done.stderr else "")
        if done.launch_error:
            return unread(f"could not start `{command}`: {done.launch_error}")
        if done.timed_out:
            return unread(f"`{command}` did not finish within {timeout_s:g} s", output)
        if done.returncode:
            tail = " ".join(output.split())[-300:] or "no output"
            return unread(f"`{command}` exited {done.returncode}: {tail}", output)
        try:
            snapshot = json.loads(done.stdout.strip().splitlines()[-1])
            return _reading(node, snapshot, output, started)
        except (ValueError, IndexError, KeyError, TypeError) as error:
            return unread(f"NVML probe output unusable ({type(error).__name__}: {error})", output)


def _links(states: dict[str, bool] | None, up: bool) -> tuple[int, ...]:
    return tuple(sorted(int(link) for link, state in (states or {}).items() if state is up))


def _reading(node: str, snapshot: dict[str, Any], output: str, started: datetime) -> InstanceReading:
    if snapshot["type"] == "Unavailable":
        why = f"NVML on {node}: {snapshot['reason']}"
        return InstanceReading(
            node, error=why, output=output, started_at=started, finished_at=datetime.now(UTC)
        )
    if snapshot["type"] != "NodeSnapshot":
        raise ValueError(f"a {snapshot['type']}, not a NodeSnapshot")
    gpus = tuple(
        GpuReading(
            index=gpu["index"],
            name=gpu["name"],
            lost=gpu["lost"],
            links_up=_links(gpu["nvlinks"], True),
            links_down=_links(gpu["nvlinks"], False),
        )
        for gpu in snapshot["gpus"]
    )
    return InstanceReading(
        node,
        gpu_count=int(snapshot["gpu_count"]),
        gpus=gpus,
        output=output,
        started_at=started,
        finished_at=datetime.now(UTC),
    )
