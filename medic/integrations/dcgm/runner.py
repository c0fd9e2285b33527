"""Running a command on a GPU node with a hard time limit: here, through `srun`, or over `ssh`.

Every runner returns a `Completed`, never raises for a command that failed, hung or could not
start: the caller (DcgmDiagnostics) turns each of those into a clear "error" verdict.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from medic.errors import PermanentError

# dcgmi stops the diagnostic it started on nv-hostengine when it gets SIGTERM; SIGKILL would
# leave the hostengine's test running on the GPUs. So: TERM first, KILL after this grace.
DEFAULT_TERM_GRACE_S = 5.0
# After the kill, how long to wait for output pipes a runaway grandchild may still hold open.
_DRAIN_S = 2.0
SSH_CONNECT_TIMEOUT_S = 10
# srun waits for resources as long as it takes; a node that is drained or busy with a job would
# turn into a misleading "dcgmi hung". Give up on the allocation after this instead.
SRUN_IMMEDIATE_S = 30


@dataclass(frozen=True, slots=True)
class Completed:
    argv: tuple[str, ...]
    stdout: str
    stderr: str
    returncode: int | None  # None: it never started, or could not be reaped after the kill
    timed_out: bool = False
    duration_s: float = 0.0
    launch_error: str | None = None  # the command never started (missing program, wrong node)

    def failure(self, what: str, limit_s: float) -> str | None:
        """Why `what` gave nothing to use, or None when it ran to the end and exited 0."""
        if self.launch_error:
            return f"{what}: could not start: {self.launch_error}"
        if self.timed_out:
            return f"{what}: did not finish within {limit_s:g} s"
        if self.returncode:
            tail = " ".join((self.stderr or self.stdout).split())[-200:] or "no message"
            return f"{what}: exited {self.returncode}: {tail}"
        return None


@runtime_checkable
class NodeRunner(Protocol):
    def run(self, node: str, argv: Sequence[str], timeout_s: float) -> Completed: ...


def run_process(
    argv: Sequence[str],
    timeout_s: float,
    *,
    env: Mapping[str, str] | None = None,
    term_grace_s: float = DEFAULT_TERM_GRACE_S,
) -> Completed:
    """Run `argv` here; past `timeout_s` its whole process group is terminated, then killed."""
    argv = tuple(argv)
    started = time.monotonic()
    try:
        # A session of its own: the kill reaches every process it started, not just the first.
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=None if env is None else dict(env),
            start_new_session=True,
        )
    except OSError as error:
        # The shell's conventions: 127 for a missing program, 126 for one that cannot run.
        code = 127 if isinstance(error, FileNotFoundError) else 126
        why = f"{argv[0]}: {error.strerror or error}"
        return Completed(argv, "", why, code, launch_error=why)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        out, err = _stop(proc, term_grace_s)
        timed_out = True
    return Completed(
        argv,
        _text(out),
        _text(err),
        proc.returncode,
        timed_out=timed_out,
        duration_s=time.monotonic() - started,
    )


def _stop(proc: subprocess.Popen[bytes], term_grace_s: float) -> tuple[bytes, bytes]:
    """TERM the process group, KILL it after the grace, and collect what it printed."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=term_grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=_DRAIN_S)
    except subprocess.TimeoutExpired:
        # A descendant left the group (setsid) and holds the pipes, or the process is stuck in
        # the kernel, as a hung GPU driver can leave it: stop waiting for either.
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_DRAIN_S)
        return b"", b""


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pgid, sig)


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", errors="replace")


def _this_host() -> frozenset[str]:
    name = socket.gethostname()
    return frozenset({"localhost", name, name.split(".")[0], socket.getfqdn()})


class LocalRunner:
    """Runs on this machine: for GPU Medic running on the GPU node itself.

    Refuses other nodes, so a misconfigured controller never reports its own GPUs' health as
    another node's. `aliases` adds names the scheduler knows this machine by.
    """

    def __init__(self, aliases: Collection[str] = (), term_grace_s: float = DEFAULT_TERM_GRACE_S) -> None:
        self.names = _this_host() | frozenset(aliases)
        self.term_grace_s = term_grace_s

    def run(self, node: str, argv: Sequence[str], timeout_s: float) -> Completed:
        if node not in self.names:
            why = (
                f"the local runner runs on {socket.gethostname()} only, not on {node}; "
                "set MEDIC_DCGM_RUNNER=srun or ssh"
            )
            return Completed(tuple(argv), "", why, None, launch_error=why)
        return run_process(argv, timeout_s, term_grace_s=self.term_grace_s)


class SrunRunner:
    """Runs as a one-task Slurm job on the node; srun forwards our TERM to the remote command.

    Slurm allocates nothing on a drained node and waits while a job holds the node's resources
    (SRUN_IMMEDIATE_S bounds that wait); the ssh runner has neither limit (docs/dcgm.md).
    """

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        slurm_conf: str | None = None,
        term_grace_s: float = DEFAULT_TERM_GRACE_S,
    ) -> None:
        self.extra_args = tuple(extra_args)
        self.slurm_conf = slurm_conf
        self.term_grace_s = term_grace_s

    def command(self, node: str, argv: Sequence[str]) -> list[str]:
        return [
            "srun",
            "-w",
            node,
            "--ntasks=1",
            f"--immediate={SRUN_IMMEDIATE_S}",
            "--quiet",
            *self.extra_args,
            *argv,
        ]

    def env(self) -> dict[str, str] | None:
        if self.slurm_conf is None:
            return None
        return {**os.environ, "SLURM_CONF": self.slurm_conf}

    def run(self, node: str, argv: Sequence[str], timeout_s: float) -> Completed:
        return run_process(
            self.command(node, argv), timeout_s, env=self.env(), term_grace_s=self.term_grace_s
        )


class SshRunner:
    """Runs over ssh without prompts. Killing ssh here does not stop the remote command, so the
    remote side runs under timeout(1) with a slightly longer limit: a dropped connection
    cannot leave dcgmi running on the node forever."""

    def __init__(self, extra_args: Sequence[str] = (), term_grace_s: float = DEFAULT_TERM_GRACE_S) -> None:
        self.extra_args = tuple(extra_args)
        self.term_grace_s = term_grace_s

    def command(self, node: str, argv: Sequence[str], timeout_s: float) -> list[str]:
        remote_limit = math.ceil(timeout_s + self.term_grace_s)
        grace = math.ceil(self.term_grace_s) or 1
        remote = ["timeout", f"--kill-after={grace}", str(remote_limit), *argv]
        return [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}",
            *self.extra_args,
            "--",  # a node name can never be read as an ssh option
            node,
            shlex.join(remote),  # ssh hands the remote shell one string: quote each word
        ]

    def run(self, node: str, argv: Sequence[str], timeout_s: float) -> Completed:
        return run_process(self.command(node, argv, timeout_s), timeout_s, term_grace_s=self.term_grace_s)


RUNNERS = ("local", "srun", "ssh")


class RunnerConfigError(PermanentError, ValueError):
    """Raised when MEDIC_DCGM_RUNNER or MEDIC_DCGM_RUNNER_ARGS asks for a runner that cannot be built."""


def runner_from_env(env: Mapping[str, str]) -> NodeRunner:
    """MEDIC_DCGM_RUNNER (local | srun | ssh, default ssh: it also reaches drained nodes),
    MEDIC_DCGM_RUNNER_ARGS (extra srun/ssh arguments, shell-quoted) and SLURM_CONF."""
    kind = env.get("MEDIC_DCGM_RUNNER") or "ssh"
    extra = shlex.split(env.get("MEDIC_DCGM_RUNNER_ARGS", ""))
    match kind:
        case "local":
            if extra:
                raise RunnerConfigError("MEDIC_DCGM_RUNNER_ARGS applies to srun and ssh, not local")
            return LocalRunner()
        case "srun":
            return SrunRunner(extra, slurm_conf=env.get("SLURM_CONF") or None)
        case "ssh":
            return SshRunner(extra)
    raise RunnerConfigError(f"MEDIC_DCGM_RUNNER={kind!r}: choose one of {', '.join(RUNNERS)}")
