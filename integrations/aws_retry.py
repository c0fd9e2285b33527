"""Retrying AWS calls that were throttled: exponential backoff with jitter, a bounded number of tries.

botocore retries a few times on its own; this outer layer rides out sustained throttling (a remediation
storm hitting the account's API rate) with longer, logged pauses, and then gives up so the caller can
report the failure instead of hanging.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from botocore.exceptions import ClientError

log = logging.getLogger(__name__)
T = TypeVar("T")

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


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", "Unknown"))


def is_throttling(error: ClientError) -> bool:
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return error_code(error) in THROTTLING_CODES or status == 429


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 5  # calls in all, the first included
    base_s: float = 0.5
    cap_s: float = 20.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")

    def delay(self, retry: int, unit_random: float) -> float:
        """Pause before retry number `retry` (0-based): half the exponential step, plus up to as much again
        at random, so many workers throttled together do not retry in lockstep."""
        step = min(self.cap_s, self.base_s * 2**retry)
        return step / 2 + unit_random * step / 2


class Retrier:
    def __init__(
        self,
        policy: RetryPolicy,
        sleep: Callable[[float], None],
        unit_random: Callable[[], float] = random.random,
    ) -> None:
        self.policy = policy
        self._sleep = sleep
        self._random = unit_random

    def call(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """`fn(**kwargs)`, retried while AWS throttles it; the last throttling error is re-raised."""
        retry = 0
        while True:
            try:
                return fn(**kwargs)
            except ClientError as error:
                if not is_throttling(error) or retry + 1 >= self.policy.attempts:
                    raise
                pause = self.policy.delay(retry, self._random())
                log.warning(
                    "%s throttled (%s); retry %d of %d in %.2f s",
                    error.operation_name,
                    error_code(error),
                    retry + 1,
                    self.policy.attempts - 1,
                    pause,
                )
                self._sleep(pause)
                retry += 1
