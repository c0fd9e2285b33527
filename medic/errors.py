"""The one error root of GPU Medic, and its two branches: worth trying again, or not.

Every error the project raises on purpose derives from `MedicError`. Where the cause is clear it
also derives from one branch:

- `TransientError`: the request was not carried out and may be on a second try (throttled, a
  timeout before an answer, a connection refused, a 5xx).
- `PermanentError`: the same request would be refused again (a bad request, an unknown node, an
  owner check, an action the backend does not offer).

A `MedicError` on neither branch, like any exception from outside the project, is *unknown*: it is
not retried, and the incident escalates (fail closed). Which layer retries what:
docs/decisions/0004-retry-ownership.md. The domain only defines the contract; the Prefect task
layer applies it (`medic/tasks/runtime/retry.py`), the integrations raise the right branch.

Classes that existed before this root keep their builtin bases (`RuntimeError`, `ValueError`,
`LookupError`), so every `except` written against those still catches them.
"""

from __future__ import annotations


class MedicError(Exception):
    """Raised when GPU Medic itself detects a failure; the root of every project error."""


class TransientError(MedicError):
    """Raised when a request was not carried out but may be on a later try: throttling, a timeout,
    a connection refused, a server error. The Prefect task layer retries these, and only these."""


class PermanentError(MedicError):
    """Raised when trying again cannot help: the request is malformed, names something that does
    not exist, is refused by an owner check, or asks for something the backend does not offer."""


def is_transient(error: BaseException) -> bool:
    """True only for a `TransientError`: unknown errors are not retried."""
    return isinstance(error, TransientError)
