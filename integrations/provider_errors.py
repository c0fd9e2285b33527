"""Errors the real node providers raise, so the flow can tell a refused action from a bad name."""

from __future__ import annotations


class ProviderError(RuntimeError):
    """The backend could not do what was asked."""


class UnknownNodeError(ProviderError, LookupError):
    """No instance answers to this node name under the provider's mapping rule."""


class InvalidNodeIdError(ProviderError, ValueError):
    """An id that the cloud API would reject; caught before any request is sent."""


class NodeActionError(ProviderError):
    """The API refused or failed the action for this one node."""

    def __init__(self, node: str, code: str, message: str) -> None:
        super().__init__(f"{node}: {code}: {message}")
        self.node = node
        self.code = code
        self.message = message
