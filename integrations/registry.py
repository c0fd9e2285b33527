"""Choosing backends by configuration (MEDIC_SCHEDULER / MEDIC_PROVIDER, see medic/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from integrations.protocols import CheckpointStore, Diagnostics, NodeProvider, Notifier, Scheduler
from integrations.sim.checkpoints import SimCheckpoints
from integrations.sim.diagnostics import SimDiagnostics
from integrations.sim.fleet import SimFleet
from integrations.sim.notifier import RecordingNotifier
from integrations.sim.provider import SimProvider
from integrations.sim.scheduler import SimScheduler
from medic.config import Settings

AVAILABLE = {"scheduler": ("sim",), "provider": ("sim",)}


class BackendError(ValueError):
    pass


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


def from_settings(settings: Settings) -> Backends:
    for role, chosen in (("scheduler", settings.scheduler), ("provider", settings.provider)):
        if chosen not in AVAILABLE[role]:
            raise BackendError(
                f"MEDIC_{role.upper()}={chosen!r} is not available; choose one of {', '.join(AVAILABLE[role])}"
            )
    return simulated()[0]
