"""Recording a stage: every task writes what it did, how it ended and how long it took.

The same words go into one line of the run's log, so the Prefect UI's log tab tells the
incident's story step by step (what, on which node, why, how it ended) beside Prefect's own
"Finished in state" lines.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from medic.statuses import StepStatus
from medic.store import Store, utcnow

logger = logging.getLogger("medic.stage")


def run_logger(fallback: logging.Logger = logger) -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The run's logger (its lines show in the Prefect UI) where there is a run, else `fallback`."""
    try:
        return get_run_logger()
    except MissingContextError:
        return fallback


@dataclass(slots=True)
class StageLog:
    summary: str = ""
    status: str = StepStatus.OK
    detail: dict[str, Any] = field(default_factory=dict)

    def done(self, summary: str, status: str = StepStatus.OK, **detail: Any) -> None:
        self.summary, self.status = summary, status
        self.detail.update(detail)


@contextmanager
def stage(
    store: Store, incident_id: str, name: str, *, node: str | None = None, why: str = ""
) -> Iterator[StageLog]:
    """Time the block and write one step row, also when it raises (then Prefect may retry), and say
    in the run's log what happened: `name`, `on node`, `(why)`, then the status and the summary."""
    heading = f"{name}{f' on {node}' if node else ''}{f' ({why})' if why else ''}"
    log = StageLog()
    started = utcnow()
    try:
        yield log
    except Exception as error:
        failure = f"{type(error).__name__}: {error}"
        store.add_step(incident_id, name, started, StepStatus.FAILED, failure, log.detail)
        run_logger().warning("%s → %s: %s", heading, StepStatus.FAILED, failure)
        raise
    store.add_step(incident_id, name, started, log.status, log.summary, log.detail)
    level = logging.WARNING if log.status == StepStatus.FAILED else logging.INFO
    run_logger().log(level, "%s → %s: %s", heading, log.status, log.summary)
