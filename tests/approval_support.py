"""Running a flow that pauses for a human's approval, and finding its paused run: for the approval
tests and the contain mode's (tests/orchestration/test_approval.py, test_modes.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client

from medic.flows.dispatch import remediate_all
from medic.intake import read_lines
from medic.tasks.runtime.process import Runtime


def run_in_background(rt: Runtime, lines: list[str]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def target() -> None:
        result["dispatch"] = asyncio.run(remediate_all(rt, read_lines(lines, "t.jsonl")))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def paused_run(rt: Runtime, node: str, timeout_s: float = 60) -> UUID:
    deadline = time.monotonic() + timeout_s

    async def state(run_id: UUID) -> bool:
        async with get_client() as client:
            run = await client.read_flow_run(run_id)
            return bool(run.state and run.state.is_paused())

    while time.monotonic() < deadline:
        found = rt.store.find_incidents(node=node)
        if found and found[0].status == "waiting for approval" and found[0].flow_run_id:
            run_id = UUID(found[0].flow_run_id)
            if asyncio.run(state(run_id)):
                return run_id
        time.sleep(0.3)
    found = rt.store.find_incidents(node=node)
    raise AssertionError(f"the flow run never paused for approval: {found}")
