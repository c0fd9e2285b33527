"""Choosing backends by configuration (env vars; see medic/config.py and docs/cli.md).

| variable          | values                               | default |
| ----------------- | ------------------------------------ | ------- |
| MEDIC_SCHEDULER   | sim, slurm                           | sim     |
| MEDIC_PROVIDER    | sim, slurm, hyperpod, ec2            | sim     |
| MEDIC_DIAGNOSTICS | sim, dcgm                            | sim     |
| MEDIC_CHECKPOINTS | sim, or a directory of DCP checkpoints | sim   |
| SLACK_BOT_TOKEN   | set: post to Slack; unset: keep messages in memory (the demo prints them) |

Simulated backends share one in-process fleet, so a real scheduler can be paired with a
simulated provider (e.g. Slurm with simulated reboots) and vice versa. Real backends are
imported only when chosen: a simulated setup never needs boto3 credentials or Slurm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from integrations.sim.checkpoints import SimCheckpoints
from integrations.sim.diagnostics import SimDiagnostics
from integrations.sim.fleet import SimFleet
from integrations.sim.notifier import RecordingNotifier
from integrations.sim.provider import SimProvider
from integrations.sim.scheduler import SimScheduler
from medic.config import Settings
from medic.errors import PermanentError
from medic.protocols import CheckpointStore, Diagnostics, NodeProvider, Notifier, Scheduler


class BackendError(PermanentError, ValueError):
    """Raised when the configuration names a backend that does not exist or cannot be built."""


@dataclass(slots=True)
class Backends:
    scheduler: Scheduler
    provider: NodeProvider
    diagnostics: Diagnostics
    notifier: Notifier
    checkpoints: CheckpointStore


def simulated(fleet: SimFleet | None = None) -> tuple[Backends, SimFleet]:
    fleet = fleet or SimFleet.build()
    backends = Backends(
        scheduler=SimScheduler(fleet),
        provider=SimProvider(fleet),
        diagnostics=SimDiagnostics(fleet),
        notifier=RecordingNotifier(),
        checkpoints=SimCheckpoints(fleet),
    )
    return backends, fleet


Env = Mapping[str, str]


def _slurm_scheduler(env: Env) -> Scheduler:
    from integrations.slurm.cli import SlurmCli
    from integrations.slurm.scheduler import SlurmScheduler

    return SlurmScheduler(SlurmCli.from_env(env))


def _slurm_provider(env: Env) -> NodeProvider:
    from integrations.slurm.provider import SlurmRebootProvider

    return SlurmRebootProvider.from_env(env)


def _hyperpod(env: Env) -> NodeProvider:
    from integrations.hyperpod import HyperPodProvider

    return HyperPodProvider.from_env(env)


def _ec2(env: Env) -> NodeProvider:
    from integrations.ec2 import Ec2Provider

    return Ec2Provider.from_env(env)


def _dcgm(env: Env) -> Diagnostics:
    from integrations.dcgm.diagnostics import DcgmDiagnostics

    return DcgmDiagnostics.from_env(env)


REAL: dict[str, dict[str, Callable[[Env], Any]]] = {
    "scheduler": {"slurm": _slurm_scheduler},
    "provider": {"slurm": _slurm_provider, "hyperpod": _hyperpod, "ec2": _ec2},
    "diagnostics": {"dcgm": _dcgm},
}


def _choose(role: str, chosen: str, env: Env, simulated_one: Any) -> Any:
    if chosen == "sim":
        return simulated_one
    factory = REAL[role].get(chosen)
    if factory is None:
        choices = ", ".join(["sim", *REAL[role]])
        raise BackendError(f"MEDIC_{role.upper()}={chosen!r} is not available; choose one of {choices}")
    try:
        return factory(env)
    except ValueError as error:  # a missing or malformed setting, named by the backend
        raise BackendError(f"MEDIC_{role.upper()}={chosen}: {error}") from None


def _notifier(env: Env, fallback: Notifier) -> Notifier:
    if not env.get("SLACK_BOT_TOKEN") and not env.get("MEDIC_SLACK_TOKEN_BLOCK"):
        return fallback
    from integrations.slack.notifier import SlackNotifier

    return SlackNotifier.from_env(env) or fallback


def _checkpoints(env: Env, fallback: CheckpointStore) -> CheckpointStore:
    """`sim`, a directory of DCP checkpoints (root/JOB/step-N), or s3://bucket/prefix."""
    chosen = env.get("MEDIC_CHECKPOINTS", "sim")
    if chosen == "sim":
        return fallback
    if chosen.startswith("s3://"):
        from integrations.aws_clients import aws_client
        from integrations.checkpoints import S3CheckpointStore

        bucket, _, prefix = chosen.removeprefix("s3://").partition("/")
        return S3CheckpointStore(aws_client("s3", env), bucket, prefix)
    from integrations.checkpoints import DcpCheckpointStore

    return DcpCheckpointStore(chosen)


def from_settings(settings: Settings, env: Env | None = None) -> Backends:
    env = settings.env if env is None else env
    sim, _ = simulated()
    return Backends(
        scheduler=_choose("scheduler", settings.scheduler, env, sim.scheduler),
        provider=_choose("provider", settings.provider, env, sim.provider),
        diagnostics=_choose("diagnostics", env.get("MEDIC_DIAGNOSTICS", "sim"), env, sim.diagnostics),
        notifier=_notifier(env, sim.notifier),
        checkpoints=_checkpoints(env, sim.checkpoints),
    )
