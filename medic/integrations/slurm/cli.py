"""Running Slurm's client commands: one place for the environment, timeouts and error messages."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from medic.integrations.slurm.errors import (
    SlurmCommandError,
    SlurmNotInstalledError,
    SlurmRejectedError,
    SlurmUnreachableError,
    UnknownSlurmNodeError,
)
from medic.integrations.slurm.records import (
    SlurmJob,
    SlurmNode,
    boot_time,
    generation,
    parse_jobs,
    parse_nodes,
)

DEFAULT_TIMEOUT_S = 30.0
# What the Slurm tools print (lower-cased) when slurmctld does not answer: worth asking again.
UNREACHABLE = (
    "unable to contact slurm controller",
    "socket timed out",
    "zero bytes were transmitted or received",
    "connection refused",
    "communication connection failure",
    "resource temporarily unavailable",
    "standby mode",
)


def _unreachable(said: str) -> bool:
    return any(marker in said.lower() for marker in UNREACHABLE)


# `scontrol -o show reservation`: one reservation a line, `Key=Value` fields.
_RESERVATION_FIELD = re.compile(r"(\w+)=(\S*)")


class SlurmCli:
    """Runs `scontrol`, `sinfo` and `squeue` against one cluster.

    `slurm_conf` overrides SLURM_CONF; left None, the commands see the environment as it is when they
    run, so SLURM_CONF (or the tools' compiled-in default) applies. A slurmctld that does not answer
    within `timeout_s` is an error, not a hang.
    """

    def __init__(self, slurm_conf: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.slurm_conf = slurm_conf
        self.timeout_s = timeout_s
        # Learnt at the first node read: whether sinfo lists nodes (22.05) or scontrol must (23.02+).
        self._nodes_from_scontrol = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmCli:
        """Bound to the SLURM_CONF in `env` (a configuration read once), not the process environment."""
        return cls(slurm_conf=env.get("SLURM_CONF"))

    def _env(self) -> Mapping[str, str]:
        env = dict(os.environ)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        return env

    def run(self, *args: str) -> str:
        """Run one command; its stdout, or the SlurmCommandError of its branch carrying what Slurm
        printed: unreachable (transient) when slurmctld did not answer, rejected (permanent) when it
        answered no."""
        command = list(args)
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=self.timeout_s, env=self._env(), check=False
            )
        except FileNotFoundError as error:
            raise SlurmNotInstalledError(command, f"{command[0]} is not installed or not on PATH") from error
        except subprocess.TimeoutExpired as error:
            raise SlurmUnreachableError(command, f"no answer within {self.timeout_s:.0f} s") from error
        if done.returncode != 0:
            said = " ".join((done.stderr + " " + done.stdout).split()) or "no message"
            failed = SlurmUnreachableError if _unreachable(said) else SlurmRejectedError
            raise failed(command, f"rc={done.returncode}: {said}", done.returncode)
        return done.stdout

    def _json(self, *command: str) -> dict[str, Any]:
        out = self.run(*command)
        try:
            data = json.loads(out)
        except json.JSONDecodeError as error:
            raise SlurmCommandError(list(command), f"output is not JSON: {out[:200]!r}") from error
        if not isinstance(data, dict):
            raise SlurmCommandError(list(command), f"output is not a JSON object: {out[:200]!r}")
        if data.get("errors"):
            failed = SlurmUnreachableError if _unreachable(str(data["errors"])) else SlurmCommandError
            raise failed(list(command), f"Slurm reported errors: {data['errors']}")
        return data

    def nodes(self) -> list[SlurmNode]:
        """Every node, read in the JSON generation the cluster's Slurm writes (records.py)."""
        return parse_nodes(self.node_document())

    def node_document(self) -> dict[str, Any]:
        """Every node's full record as Slurm wrote it, in one command once the release is known.

        22.05's `sinfo --json` lists each node (it ignores -n and every other filter: always the whole
        cluster). From 23.02 on `sinfo --json` lists sinfo's grouped rows instead (one row for several
        nodes), so the nodes come from `scontrol --json show nodes`, one full record per node; sinfo is
        then not asked again (Slurm is not downgraded under a running service)."""
        if not self._nodes_from_scontrol:
            listing = self._json("sinfo", "--json")
            if generation(listing, "sinfo --json") == 38:
                return listing
            self._nodes_from_scontrol = True
        return self._json("scontrol", "--json", "show", "nodes")

    def node(self, name: str) -> SlurmNode:
        for node in self.nodes():
            if node.name == name:
                return node
        raise UnknownSlurmNodeError(name)

    def node_and_boot(self, name: str) -> tuple[SlurmNode, int | None]:
        """The node and its BootTime (epoch seconds; None before slurmd ever registered), from one read."""
        doc = self.node_document()
        for raw, node in zip(doc["nodes"], parse_nodes(doc), strict=True):
            if node.name == name:
                return node, boot_time(raw, name)
        raise UnknownSlurmNodeError(name)

    def booted_at(self, name: str) -> datetime | None:
        """The node's BootTime as slurmd last registered it; None before it ever did."""
        booted = self.node_and_boot(name)[1]
        return None if booted is None else datetime.fromtimestamp(booted, UTC)

    def jobs(self) -> list[SlurmJob]:
        # Likewise squeue --json ignores -j/-w/-u: all jobs Slurm still remembers (MinJobAge).
        return parse_jobs(self._json("squeue", "--json"))

    def scontrol(self, *args: str) -> str:
        return self.run("scontrol", *args)

    def reservations(self) -> dict[str, list[str]]:
        """Every reservation Slurm holds: name -> its nodes (a hostlist like `n[1-3]` expanded)."""
        found = {}
        for line in self.scontrol("-o", "show", "reservation").splitlines():
            fields = dict(_RESERVATION_FIELD.findall(line))
            if fields.get("ReservationName"):
                found[fields["ReservationName"]] = self._hostnames(fields.get("Nodes", ""))
        return found

    def _hostnames(self, hostlist: str) -> list[str]:
        if not hostlist or hostlist == "(null)":
            return []
        if "[" not in hostlist:
            return hostlist.split(",")
        return self.scontrol("show", "hostnames", hostlist).split()
