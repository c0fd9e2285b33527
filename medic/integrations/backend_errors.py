"""The error of a backend configured wrong, apart from the registry that builds the backends: the CLI
catches it at every start, and `medic triage` must not load the simulated fleet to do so."""

from __future__ import annotations

from medic.errors import PermanentError


class BackendError(PermanentError, ValueError):
    """Raised when the configuration names a backend that does not exist or cannot be built."""
