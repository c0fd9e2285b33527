"""Retrying AWS calls that were throttled: exponential backoff with jitter, a bounded number of tries.

botocore retries a few times on its own; this outer layer rides out sustained throttling (a remediation
storm hitting the account's API rate) with longer, logged pauses, and then gives up so the caller can
report the failure instead of hanging.

With botocore's beneath it, this is the one layer that retries a single AWS call: whatever error
ends the call leaves as the `AwsApiError` of its branch (`aws_errors.py`), still a `ClientError`, so the
task layer knows whether one more try of the whole action can help (docs/decisions/0004).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from botocore.exceptions import ClientError

from medic.integrations.aws_errors import THROTTLING_CODES, api_error, error_code, is_throttling

__all__ = ["THROTTLING_CODES", "Retrier", "RetryPolicy", "error_code", "is_throttling"]

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        """`fn(**kwargs)`, retried while AWS throttles it. The error that ends it (the last throttling
        error, or any other at once) is raised as the `AwsApiError` of its branch."""
        retry = 0
        while True:
            try:
                return fn(**kwargs)
            except ClientError as error:
                if not is_throttling(error) or retry + 1 >= self.policy.attempts:
                    raise api_error(error) from error
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
