"""Slurm backends: `SlurmScheduler` (a `Scheduler`) and `SlurmRebootProvider` (a `NodeProvider`).

Both drive Slurm's own command-line tools (`scontrol`, `sinfo --json`, `squeue --json`), the same way an
admin would, through `SlurmCli`; they need no daemon or REST service of their own. Behaviour measured on
Slurm 22.05 is described in docs/slurm.md.
"""

from medic.integrations.slurm.cli import SlurmCli
from medic.integrations.slurm.errors import (
    NodeHeldByOthersError,
    NotRequeueableError,
    ResumeRefusedError,
    SlurmCommandError,
    SlurmError,
    SlurmNotInstalledError,
    SlurmRejectedError,
    SlurmUnreachableError,
    UnknownJobError,
    UnknownSlurmNodeError,
    UnreadableSlurmDataError,
    UnsupportedSlurmActionError,
    UnsupportedSlurmFormatError,
)
from medic.integrations.slurm.provider import SlurmRebootProvider
from medic.integrations.slurm.scheduler import SlurmScheduler

__all__ = [
    "NodeHeldByOthersError",
    "NotRequeueableError",
    "ResumeRefusedError",
    "SlurmCli",
    "SlurmCommandError",
    "SlurmError",
    "SlurmNotInstalledError",
    "SlurmRebootProvider",
    "SlurmRejectedError",
    "SlurmScheduler",
    "SlurmUnreachableError",
    "UnknownJobError",
    "UnknownSlurmNodeError",
    "UnreadableSlurmDataError",
    "UnsupportedSlurmActionError",
    "UnsupportedSlurmFormatError",
]
