"""The task layer's retry rule: Prefect tries a task again only when it failed with a TransientError.

The integrations retry the single library calls they own (botocore, `medic/integrations/aws_retry.py`,
the Slack notifier's time budget) and raise the branch of `medic.errors` that says what is left.
A task retries the whole stage only for `TransientError`; a `PermanentError`, an unknown error
(anything else, a task timeout included) fails the task at once, and the flow escalates
(docs/decisions/0004-retry-ownership.md). Tasks opt in with `retry_condition_fn=transient_only`.
"""

from __future__ import annotations

from typing import Any

from prefect import Task
from prefect.client.schemas.objects import State, TaskRun

from medic.errors import is_transient


def transient_only(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect's `retry_condition_fn`: True only when the failed run raised a TransientError.

    Prefect hands the raised exception over as the Failed state's data; anything else there (a
    returned Failed state, a result record) is not known to be transient, so it is not retried."""
    return isinstance(state.data, BaseException) and is_transient(state.data)
