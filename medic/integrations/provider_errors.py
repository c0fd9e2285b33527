"""Errors the real node providers raise, so the flow can tell a refused action from a bad name.

Each sits under `medic.errors.MedicError`; those whose cause is clear are also transient or
permanent (docs/decisions/0004-retry-ownership.md). `ProviderError` and a bare `NodeActionError`
are neither: the outcome is unknown, so nothing retries them and the incident escalates.
"""

from __future__ import annotations

from medic.errors import MedicError, PermanentError, TransientError


class ProviderError(MedicError, RuntimeError):
    """Raised when the backend could not do what was asked, for a reason not classified further."""


class UnknownNodeError(ProviderError, PermanentError, LookupError):
    """Raised when no instance answers to this node name under the provider's mapping rule."""


class InvalidNodeIdError(ProviderError, PermanentError, ValueError):
    """Raised when an id would be rejected by the cloud API; caught before any request is sent."""


class AmbiguousNodeError(ProviderError, PermanentError):
    """Raised when a node name matches more than one instance: the provider never guesses."""


class ActionRefusedError(ProviderError, PermanentError):
    """Raised when the provider rules the action out before trying it: the backend does not offer it,
    or its own settings would defeat it (an Auto Scaling group with replacement suspended)."""


class NodeActionError(ProviderError):
    """Raised when the API refused or failed the action for this one node, and its code does not say
    whether the action may have happened (a read timeout, a node the batch did not report on)."""

    def __init__(self, node: str, code: str, message: str) -> None:
        super().__init__(f"{node}: {code}: {message}")
        self.node = node
        self.code = code
        self.message = message


class TransientNodeActionError(NodeActionError, TransientError):
    """Raised when the API did not carry out the action for this node and said to try again later:
    throttled, busy with another operation, or failing inside."""


class PermanentNodeActionError(NodeActionError, PermanentError):
    """Raised when the API refused the action for this node for good: an unknown instance, a request
    it rejects, a permission it does not grant."""
