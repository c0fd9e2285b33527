"""What goes wrong talking to Slurm, each error naming the node or job it concerns."""

from __future__ import annotations

from integrations.provider_errors import ProviderError, UnknownNodeError


class SlurmError(ProviderError):
    """Slurm could not do what was asked."""


class SlurmCommandError(SlurmError):
    """A Slurm command failed, timed out or could not be started."""

    def __init__(self, command: list[str], detail: str, returncode: int | None = None) -> None:
        super().__init__(f"`{' '.join(command)}` failed: {detail}")
        self.command = command
        self.detail = detail
        self.returncode = returncode


class UnknownSlurmNodeError(SlurmError, UnknownNodeError):
    def __init__(self, node: str) -> None:
        super().__init__(f"Slurm has no node named {node!r}")
        self.node = node


class UnknownJobError(SlurmError, LookupError):
    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"Slurm has no job {job_id!r} (never existed, or finished longer ago than MinJobAge)"
        )
        self.job_id = job_id


class NodeHeldByOthersError(SlurmError):
    """The node is out of service for a reason that is not ours: we neither overwrite nor act on it."""

    def __init__(self, node: str, state: str, reason: str | None, refused: str) -> None:
        super().__init__(
            f"{node} is {state} by someone else (reason: {reason or 'none given'}); "
            f"GPU Medic does not {refused} it"
        )
        self.node = node
        self.reason = reason


class ResumeRefusedError(SlurmError):
    """Only nodes that GPU Medic drained are resumed by it."""

    def __init__(self, node: str, why: str) -> None:
        super().__init__(f"not resuming {node}: {why}")
        self.node = node


class NotRequeueableError(SlurmError):
    def __init__(self, job_id: str, why: str) -> None:
        super().__init__(f"job {job_id} cannot be requeued: {why}")
        self.job_id = job_id
