"""What goes wrong talking to Slurm, each error naming the node or job it concerns.

Transient: slurmctld did not answer (SlurmUnreachableError). Permanent: Slurm answered and refused,
or an owner rule of ours refused (the rest, except the two unclassified bases below). Slurm's node
and job commands set a state, so asking again after a timeout does not act twice.
"""

from __future__ import annotations

from medic.errors import PermanentError, TransientError
from medic.integrations.provider_errors import ActionRefusedError, ProviderError, UnknownNodeError


class SlurmError(ProviderError):
    """Raised when Slurm could not do what was asked, for a reason not classified further."""


class SlurmCommandError(SlurmError):
    """Raised when a Slurm command failed, timed out or could not be started; its subclasses say
    which, and a bare one (output that is not the JSON asked for) is unclassified."""

    def __init__(self, command: list[str], detail: str, returncode: int | None = None) -> None:
        super().__init__(f"`{' '.join(command)}` failed: {detail}")
        self.command = command
        self.detail = detail
        self.returncode = returncode


class SlurmUnreachableError(SlurmCommandError, TransientError):
    """Raised when slurmctld did not answer: the command timed out, or said it could not reach the
    controller (connection refused, socket timed out)."""


class SlurmRejectedError(SlurmCommandError, PermanentError):
    """Raised when Slurm answered and refused the request (an invalid node state, permission denied,
    an operation disabled): the same request gets the same answer."""


class SlurmNotInstalledError(SlurmCommandError, PermanentError):
    """Raised when the Slurm command is not installed or not on PATH."""


class UnsupportedSlurmActionError(SlurmError, ActionRefusedError):
    """Raised when the configured Slurm convention cannot do the action (replace under scontrol)."""


class UnknownSlurmNodeError(SlurmError, UnknownNodeError):
    """Raised when Slurm has no node of this name."""

    def __init__(self, node: str) -> None:
        super().__init__(f"Slurm has no node named {node!r}")
        self.node = node


class UnknownJobError(SlurmError, PermanentError, LookupError):
    """Raised when Slurm has no job of this id (any more)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"Slurm has no job {job_id!r} (never existed, or finished longer ago than MinJobAge)"
        )
        self.job_id = job_id


class NodeHeldByOthersError(SlurmError, PermanentError):
    """Raised when the node is out of service for a reason that is not ours: we neither overwrite nor
    act on it, however often asked."""

    def __init__(self, node: str, state: str, reason: str | None, refused: str) -> None:
        super().__init__(
            f"{node} is {state} by someone else (reason: {reason or 'none given'}); "
            f"GPU Medic does not {refused} it"
        )
        self.node = node
        self.reason = reason


class ResumeRefusedError(SlurmError, PermanentError):
    """Raised when asked to resume a node GPU Medic did not drain: only those are resumed by it."""

    def __init__(self, node: str, why: str) -> None:
        super().__init__(f"not resuming {node}: {why}")
        self.node = node


class NotRequeueableError(SlurmError, PermanentError):
    """Raised when the job cannot be requeued: it has ended, or it does not allow requeues."""

    def __init__(self, job_id: str, why: str) -> None:
        super().__init__(f"job {job_id} cannot be requeued: {why}")
        self.job_id = job_id


class UnreadableSlurmDataError(SlurmError, PermanentError):
    """Raised when Slurm's JSON (a node, a job, or the document around them) cannot be read with
    certainty: an unknown field shape, state word or format generation. Fail closed: a node or job we
    cannot read is never taken for idle, free or in service, so GPU Medic refuses to act on it."""

    def __init__(self, subject: str, field: str, detail: str) -> None:
        super().__init__(f"cannot read Slurm {subject}: {field} {detail}; GPU Medic does not act on it")
        self.subject = subject
        self.field = field
        self.detail = detail


class UnsupportedSlurmFormatError(UnreadableSlurmDataError):
    """Raised when a document's metadata names a data_parser generation GPU Medic does not know (or names
    none): its fields may mean something else, so none of it is read."""
