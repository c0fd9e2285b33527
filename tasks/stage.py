"""Recording a stage: every task writes what it did, how it ended and how long it took."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from medic.statuses import StepStatus
from medic.store import Store, utcnow


@dataclass(slots=True)
class StageLog:
    summary: str = ""
    status: str = StepStatus.OK
    detail: dict[str, Any] = field(default_factory=dict)

    def done(self, summary: str, status: str = StepStatus.OK, **detail: Any) -> None:
        self.summary, self.status = summary, status
        self.detail.update(detail)


@contextmanager
def stage(store: Store, incident_id: str, name: str) -> Iterator[StageLog]:
    """Time the block and write one step row, also when it raises (then Prefect may retry)."""
    log = StageLog()
    started = utcnow()
    try:
        yield log
    except Exception as error:
        store.add_step(
            incident_id, name, started, StepStatus.FAILED, f"{type(error).__name__}: {error}", log.detail
        )
        raise
    store.add_step(incident_id, name, started, log.status, log.summary, log.detail)
