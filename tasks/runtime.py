"""What every task needs at hand: the store, the backends, and the policy in force.

One per process. The CLI and the tests install theirs with `configure`; a worker process that
runs a deployed flow builds one from the environment on first use, and refuses to with a backend
role unconfigured (`BackendNotConfiguredError`, naming each role and what to set): simulation is
chosen with MEDIC_BACKENDS=sim, never fallen back to.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from integrations import registry
from integrations.registry import Backends
from medic.config import load_settings
from medic.policy import LoadedPolicy, PolicyError, load_policy
from medic.store import Store

log = logging.getLogger("medic.runtime")


@dataclass(slots=True)
class Runtime:
    store: Store
    backends: Backends
    policy_path: Path
    _last_good: LoadedPolicy | None = field(default=None, repr=False)
    policy_problem: str | None = None

    def policy(self) -> LoadedPolicy:
        """Read the policy file now, so an edit applies to the next incident without a restart.

        A broken edit is refused: the last good policy stays in force and the problem is kept
        in `policy_problem` for the notification.
        """
        try:
            self._last_good = load_policy(self.policy_path)
            self.policy_problem = None
        except PolicyError as error:
            if self._last_good is None:
                raise
            self.policy_problem = f"policy edit refused, still using {self._last_good.sha256[:12]}: {error}"
            log.error(self.policy_problem)
        return self._last_good


_current: Runtime | None = None


def configure(runtime: Runtime) -> Runtime:
    global _current
    _current = runtime
    return runtime


def current() -> Runtime:
    if _current is None:
        settings = load_settings()
        configure(
            Runtime(Store(settings.database_url), registry.from_settings(settings), settings.policy_path)
        )
    assert _current is not None
    return _current
