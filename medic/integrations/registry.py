"""Choosing backends by configuration (env vars or the config file; medic/config.py, docs/config.md).

| role        | variable          | values                                          |
| ----------- | ----------------- | ----------------------------------------------- |
| scheduler   | MEDIC_SCHEDULER   | sim, slurm                                      |
| provider    | MEDIC_PROVIDER    | sim, slurm, hyperpod, ec2                       |
| diagnostics | MEDIC_DIAGNOSTICS | sim, dcgm                                       |
| checkpoints | MEDIC_CHECKPOINTS | sim, a directory of DCP checkpoints, s3://...   |
| notifier    | MEDIC_NOTIFIER    | slack (implied by SLACK_BOT_TOKEN), console, sim |
| GPU reset   | MEDIC_GPU_RESET   | nvidia-smi, none, sim (optional; see below)      |

Reservations (for sweeps, docs/sweeps.md) come with the scheduler: `Backends.reservations` is the
scheduler where it implements `Reservations`, else None.

The deep checks' backends (the NVML probe, the nccl-tests all-reduce) and the host evidence kept
before a reboot or replacement (docs/host-evidence.md) follow the diagnostics role: they reach the
nodes the way DCGM does, or are simulated with it.

The GPU reset (`GpuReset`, docs/gpu-reset.md) is optional: `nvidia-smi` resets a GPU in place on the
node, through DCGM's runner; `none` leaves `reset_gpu` to the provider, which reboots the node on every
real one. Unset, it is simulated beside a simulated provider and `none` beside a real one, so a site
turns real resets on by saying so.

No role falls back to the simulation: one that is not configured stops `from_settings` with a
`BackendNotConfiguredError` naming every such role and what to set. `MEDIC_BACKENDS=sim` is
how the demo and the tests choose simulation for every role they do not name.

Simulated backends share one in-process fleet, so a real scheduler can be paired with a
simulated provider (e.g. Slurm with simulated reboots) and vice versa; the simulated ones
refuse any node that is not in that fleet. Real backends are imported only when chosen: a
simulated setup never needs boto3 credentials or Slurm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from medic.config import BACKEND_ROLES, BACKENDS_VAR, SLACK_TOKEN_VARS, Choice, Settings
from medic.integrations.backend_errors import BackendError
from medic.integrations.sim.checkpoints import SimCheckpoints
from medic.integrations.sim.deep_checks import SimAllReduce, SimInstanceProbe, SimNicLoopback
from medic.integrations.sim.diagnostics import SimDiagnostics
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.sim.gpu_reset import SimGpuReset
from medic.integrations.sim.host_evidence import SimHostEvidence
from medic.integrations.sim.notifier import RecordingNotifier
from medic.integrations.sim.provider import SimProvider
from medic.integrations.sim.scheduler import SimScheduler
from medic.protocols import (
    AllReduceTest,
    CheckpointStore,
    Diagnostics,
    GpuReset,
    HostEvidence,
    InstanceProbe,
    NicLoopbackTest,
    NodeProvider,
    Notifier,
    Reservations,
    Scheduler,
    SparePool,
)

# What to set for each role, in the message of an unconfigured one.
HINTS: dict[str, str] = {
    "scheduler": "MEDIC_SCHEDULER=slurm",
    "provider": "MEDIC_PROVIDER=slurm|hyperpod|ec2",
    "diagnostics": "MEDIC_DIAGNOSTICS=dcgm",
    "checkpoints": "MEDIC_CHECKPOINTS=DIRECTORY|s3://BUCKET/PREFIX",
    "notifier": "SLACK_BOT_TOKEN or MEDIC_NOTIFIER=console",
}


class BackendNotConfiguredError(BackendError):
    """Raised when a backend role is configured nowhere: simulation is chosen, never a fallback."""

    def __init__(self, roles: list[str]) -> None:
        self.roles = roles
        lines = [
            f"no {role} configured: set {HINTS[role]} (or {BACKENDS_VAR}=sim to simulate)" for role in roles
        ]
        lines.append("(the config file's cluster section can name them too: docs/config.md)")
        super().__init__("\n".join(lines))


def require_configured(settings: Settings) -> None:
    """Raise unless every backend role is configured and MEDIC_BACKENDS, if set, says `sim`."""
    fallback = settings.env.get(BACKENDS_VAR)
    if fallback and fallback != "sim":
        raise BackendError(f"{BACKENDS_VAR}={fallback!r} is not available; the only value is sim")
    missing = settings.unconfigured()
    if missing:
        raise BackendNotConfiguredError(missing)


@dataclass(slots=True)
class Backends:
    scheduler: Scheduler
    provider: NodeProvider
    diagnostics: Diagnostics
    notifier: Notifier
    checkpoints: CheckpointStore
    instance: InstanceProbe
    all_reduce: AllReduceTest
    host_evidence: HostEvidence
    nic_loopback: NicLoopbackTest
    # None: `reset_gpu` is the provider's own (a reboot on every real provider).
    gpu_reset: GpuReset | None = None

    @property
    def spare_pool(self) -> SparePool | None:
        """The scheduler's spare pool (docs/spares.md); None where it has none."""
        return self.scheduler if isinstance(self.scheduler, SparePool) else None

    @property
    def reservations(self) -> Reservations | None:
        """The scheduler's reservations, for sweeps; None where it has none (Slurm and the simulation
        do): then nothing is swept."""
        return self.scheduler if isinstance(self.scheduler, Reservations) else None


def simulated(fleet: SimFleet | None = None) -> tuple[Backends, SimFleet]:
    fleet = fleet or SimFleet.build()
    backends = Backends(
        scheduler=SimScheduler(fleet),
        provider=SimProvider(fleet),
        diagnostics=SimDiagnostics(fleet),
        notifier=RecordingNotifier(),
        checkpoints=SimCheckpoints(fleet),
        instance=SimInstanceProbe(fleet),
        all_reduce=SimAllReduce(fleet),
        host_evidence=SimHostEvidence(fleet),
        nic_loopback=SimNicLoopback(fleet),
        gpu_reset=SimGpuReset(fleet),
    )
    return backends, fleet


Env = Mapping[str, str]


# Each factory gets the configured scheduler too: a provider beside it must see who holds a node
# (an admin's drain there) before it reboots or replaces it.
def _slurm_scheduler(env: Env, scheduler: Scheduler | None) -> Scheduler:
    from medic.integrations.slurm.cli import SlurmCli
    from medic.integrations.slurm.scheduler import SlurmScheduler

    return SlurmScheduler(SlurmCli.from_env(env))


def _slurm_provider(env: Env, scheduler: Scheduler | None) -> NodeProvider:
    from medic.integrations.slurm.provider import SlurmRebootProvider

    return SlurmRebootProvider.from_env(env)


def _hyperpod(env: Env, scheduler: Scheduler | None) -> NodeProvider:
    from medic.integrations.hyperpod import HyperPodProvider

    return HyperPodProvider.from_env(env, scheduler)


def _ec2(env: Env, scheduler: Scheduler | None) -> NodeProvider:
    from medic.integrations.ec2 import Ec2Provider

    return Ec2Provider.from_env(env, scheduler)


def _dcgm(env: Env, scheduler: Scheduler | None) -> Diagnostics:
    from medic.integrations.dcgm.diagnostics import DcgmDiagnostics

    return DcgmDiagnostics.from_env(env)


T = TypeVar("T")


def _beside_dcgm(choice: Choice, simulated: T, real: Callable[[], T]) -> T:
    """A check that runs over DCGM's runner: real beside DCGM, simulated beside the simulation;
    a configuration the real one refuses names the variable that chose it."""
    if choice.value == "sim":
        return simulated
    try:
        return real()
    except ValueError as error:
        raise BackendError(f"{choice.variable}={choice.value}: {error}") from None


def _deep_checks(choice: Choice, env: Env, sim: Backends) -> tuple[InstanceProbe, AllReduceTest]:
    """The NVML probe and the all-reduce."""

    def real() -> tuple[InstanceProbe, AllReduceTest]:
        from medic.integrations.nccl_tests import NcclTestsAllReduce
        from medic.integrations.nvml_probe import NvmlProbe

        return NvmlProbe.from_env(env), NcclTestsAllReduce.from_env(env)

    return _beside_dcgm(choice, (sim.instance, sim.all_reduce), real)


def _nic_loopback(choice: Choice, env: Env, sim: Backends) -> NicLoopbackTest:
    """ib_write_bw in loopback."""

    def real() -> NicLoopbackTest:
        from medic.integrations.nic_loopback import IbWriteBwLoopback

        return IbWriteBwLoopback.from_env(env)

    return _beside_dcgm(choice, sim.nic_loopback, real)


def _host_evidence(choice: Choice, env: Env, sim: Backends) -> HostEvidence:
    """What a reboot or replacement wipes, read off the node."""

    def real() -> HostEvidence:
        from medic.integrations.host_evidence import NodeHostEvidence

        return NodeHostEvidence.from_env(env)

    return _beside_dcgm(choice, sim.host_evidence, real)


REAL: dict[str, dict[str, Callable[[Env, Scheduler | None], Any]]] = {
    "scheduler": {"slurm": _slurm_scheduler},
    "provider": {"slurm": _slurm_provider, "hyperpod": _hyperpod, "ec2": _ec2},
    "diagnostics": {"dcgm": _dcgm},
}


def _choose(
    role: str, choice: Choice, env: Env, simulated_one: Any, scheduler: Scheduler | None = None
) -> Any:
    chosen = choice.value
    if chosen == "sim":
        return simulated_one
    factory = REAL[role].get(chosen or "")
    if factory is None:
        choices = ", ".join(["sim", *REAL[role]])
        raise BackendError(f"{choice.variable}={chosen!r} is not available; choose one of {choices}")
    try:
        return factory(env, scheduler)
    except ValueError as error:  # a missing or malformed setting, named by the backend
        raise BackendError(f"{choice.variable}={chosen}: {error}") from None


GPU_RESET_VAR = "MEDIC_GPU_RESET"
GPU_RESETS = ("nvidia-smi", "none", "sim")


def _gpu_reset(provider: Choice, env: Env, simulated_one: GpuReset | None) -> GpuReset | None:
    """MEDIC_GPU_RESET; unset: simulated beside a simulated provider, else the provider's own."""
    chosen = env.get(GPU_RESET_VAR) or ("sim" if provider.value == "sim" else "none")
    match chosen:
        case "sim":
            return simulated_one
        case "none":
            return None
        case "nvidia-smi":
            from medic.integrations.gpu_reset import NvidiaSmiGpuReset

            try:
                return NvidiaSmiGpuReset.from_env(env)
            except ValueError as error:  # the runner's settings, named by it
                raise BackendError(f"{GPU_RESET_VAR}=nvidia-smi: {error}") from None
    raise BackendError(f"{GPU_RESET_VAR}={chosen!r} is not available; choose one of {', '.join(GPU_RESETS)}")


NOTIFIERS = ("slack", "console", "sim")


def _notifier(choice: Choice, env: Env, simulated_one: Notifier) -> Notifier:
    """`slack` (SLACK_BOT_TOKEN or MEDIC_SLACK_TOKEN_BLOCK), `console` (standard error), `sim` (memory)."""
    match choice.value:
        case "sim":
            return simulated_one
        case "console":
            from medic.integrations.console_notifier import ConsoleNotifier

            return ConsoleNotifier()
        case "slack":
            from medic.integrations.slack.notifier import SlackNotifier

            try:
                notifier = SlackNotifier.from_env(env)
            except ValueError as error:  # a malformed setting, named by the notifier
                raise BackendError(f"{choice.variable}=slack: {error}") from None
            if notifier is None:
                raise BackendError(f"{choice.variable}=slack: set {' or '.join(SLACK_TOKEN_VARS)}")
            return notifier
    raise BackendError(
        f"{choice.variable}={choice.value!r} is not available; choose one of {', '.join(NOTIFIERS)}"
    )


def _checkpoints(choice: Choice, env: Env, simulated_one: CheckpointStore) -> CheckpointStore:
    """`sim`, a directory of DCP checkpoints (root/JOB/step-N), or s3://bucket/prefix."""
    chosen = choice.value or ""
    if chosen == "sim":
        return simulated_one
    if chosen.startswith("s3://"):
        from medic.integrations.aws_clients import aws_client
        from medic.integrations.checkpoints import S3CheckpointStore

        bucket, _, prefix = chosen.removeprefix("s3://").partition("/")
        return S3CheckpointStore(aws_client("s3", env), bucket, prefix)
    from medic.integrations.checkpoints import DcpCheckpointStore

    return DcpCheckpointStore(chosen)


def _sim_nodes(env: Env) -> int:
    """MEDIC_SIM_NODES: how many nodes (gpu-node-1 … gpu-node-N) the simulated fleet has; 8 by default."""
    raw = env.get("MEDIC_SIM_NODES", "8")
    if not raw.isdigit() or not 1 <= int(raw) <= 100_000:
        raise BackendError(f"MEDIC_SIM_NODES={raw!r}: give a number of nodes from 1 to 100000")
    return int(raw)


def from_settings(settings: Settings, env: Env | None = None) -> Backends:
    """The configured backends; `BackendNotConfiguredError` when a role is configured nowhere."""
    require_configured(settings)
    env = settings.env if env is None else env
    sim, _ = simulated(SimFleet.build(nodes=_sim_nodes(env)))
    chosen = settings.backends
    assert set(chosen) == set(BACKEND_ROLES)
    scheduler = _choose("scheduler", chosen["scheduler"], env, sim.scheduler)
    provider = _choose("provider", chosen["provider"], env, sim.provider, scheduler)
    diagnostics = _choose("diagnostics", chosen["diagnostics"], env, sim.diagnostics)
    instance, all_reduce = _deep_checks(chosen["diagnostics"], env, sim)
    return Backends(
        scheduler=scheduler,
        provider=provider,
        diagnostics=diagnostics,
        notifier=_notifier(chosen["notifier"], env, sim.notifier),
        checkpoints=_checkpoints(chosen["checkpoints"], env, sim.checkpoints),
        instance=instance,
        all_reduce=all_reduce,
        host_evidence=_host_evidence(chosen["diagnostics"], env, sim),
        nic_loopback=_nic_loopback(chosen["diagnostics"], env, sim),
        gpu_reset=_gpu_reset(chosen["provider"], env, sim.gpu_reset),
    )
