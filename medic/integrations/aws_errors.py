"""AWS failures sorted onto the two branches of `medic.errors`: retrying may help, or it cannot.

The sorting happens here, at the provider boundary, where the AWS error code and HTTP status are
still at hand; nothing further up reads AWS codes (docs/decisions/0004-retry-ownership.md).

- Transient: throttling (after botocore's and `aws_retry`'s own retries ran out), a 5xx, the
  request timeouts botocore also retries, a connection never made, and the per-node codes HyperPod
  documents as "wait, then retry" (InvalidInstanceStatus, InstanceIdInUse, InternalServerError).
- Permanent: any other 4xx answer: a request AWS rejects (ValidationException), a resource it does
  not know (ResourceNotFound, InstanceIdNotFound), a permission it does not grant.
- Neither (unknown, escalates): a code with no HTTP status that is on neither list, e.g. a read
  timeout after the request was sent (the reboot may have happened) or NotReported.
"""

from __future__ import annotations

from botocore.exceptions import ClientError

from medic.errors import PermanentError, TransientError
from medic.integrations.provider_errors import (
    NodeActionError,
    PermanentNodeActionError,
    ProviderError,
    TransientNodeActionError,
)

# The error codes AWS services use for "slow down" (the same set botocore's standard retry mode treats
# as throttling; its own list is private, so it is not imported).
THROTTLING_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "TransactionInProgressException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "RequestThrottled",
        "SlowDown",
        "PriorRequestNotComplete",
        "EC2ThrottledException",
    }
)
# Not carried out, may be on a later try: botocore's transient codes, server errors, a connection
# never made (botocore exception names, as HyperPod's batch outcomes carry them), and HyperPod's
# per-node codes whose documentation says to wait and retry.
TRANSIENT_CODES = THROTTLING_CODES | {
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "InternalFailure",
    "InternalServerError",
    "ServiceUnavailable",
    "ServiceUnavailableException",
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "InvalidInstanceStatus",
    "InstanceIdInUse",
}
# HyperPod's per-node codes that no retry changes (they come without an HTTP status).
PERMANENT_CODES = frozenset({"InstanceIdNotFound", "ValidationException", "ResourceNotFound"})


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", "Unknown"))


def http_status(error: ClientError) -> int | None:
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def is_throttling(error: ClientError) -> bool:
    return error_code(error) in THROTTLING_CODES or http_status(error) == 429


def transient(code: str, status: int | None = None) -> bool | None:
    """True: retrying may help. False: it cannot. None: unknown (the action may have happened)."""
    if code in TRANSIENT_CODES or status == 429 or (status is not None and status >= 500):
        return True
    if code in PERMANENT_CODES or (status is not None and 400 <= status < 500):
        return False
    return None


class AwsApiError(ProviderError, ClientError):
    """Raised when an AWS API call failed and its answer does not say whether trying again can help.

    Still a botocore `ClientError` (same response, code and operation), so code written against
    botocore's exception keeps working."""

    def __init__(self, error_response: dict, operation_name: str) -> None:
        ClientError.__init__(self, error_response, operation_name)

    def __reduce__(self) -> tuple[type[AwsApiError], tuple[dict, str]]:
        # ClientError's own would unpickle a plain ClientError, losing the branch.
        return type(self), (self.response, self.operation_name)


class AwsThrottledError(AwsApiError, TransientError):
    """Raised when AWS still throttled the call after botocore's and `aws_retry`'s retries."""


class AwsUnavailableError(AwsApiError, TransientError):
    """Raised when AWS answered with a server error (5xx) or a request timeout."""


class AwsRequestRefusedError(AwsApiError, PermanentError):
    """Raised when AWS refused the request itself (4xx): invalid, unknown resource, not permitted."""


def api_error(error: ClientError) -> AwsApiError:
    """`error` as the `AwsApiError` of its branch (itself, when it is one already)."""
    if isinstance(error, AwsApiError):
        return error
    if is_throttling(error):
        cls: type[AwsApiError] = AwsThrottledError
    else:
        kind = transient(error_code(error), http_status(error))
        cls = {True: AwsUnavailableError, False: AwsRequestRefusedError, None: AwsApiError}[kind]
    return cls(error.response, error.operation_name)


def branch_of(error: BaseException) -> bool | None:
    """`transient`'s answer for an exception already sorted: True, False, or None (unknown)."""
    if isinstance(error, TransientError):
        return True
    if isinstance(error, PermanentError):
        return False
    return None


def node_action_error(node: str, code: str, message: str, kind: bool | None) -> NodeActionError:
    """The `NodeActionError` of branch `kind` (see `transient`): a bare one when unknown."""
    cls = {True: TransientNodeActionError, False: PermanentNodeActionError, None: NodeActionError}[kind]
    return cls(node, code, message)
