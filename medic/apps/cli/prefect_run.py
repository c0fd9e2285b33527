"""Running flows from a short-lived CLI process without losing Prefect's history."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_flows(work: Coroutine[Any, Any, T]) -> T:
    """Run `work`, then wait for Prefect's event and log workers to deliver everything.

    Without the drain, task runs recorded through events are lost when the process exits
    right after its last flow (most of them, measured on this kind of machine).
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    try:
        return asyncio.run(work)
    finally:
        EventsWorker.drain_all(timeout=30)
        APILogWorker.drain_all(timeout=30)
