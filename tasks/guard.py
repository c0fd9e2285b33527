"""Holding guardrails across concurrent flow runs.

Each flow run decides with the fleet as it saw it a moment ago; two runs could both see room
for one more node out of service and both take one. So the last check and the action happen
under one Prefect global concurrency slot (strict: a missing limit is an error, never a silent
"unlimited"), with the fleet state read again inside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency
from prefect.runtime import flow_run

from medic.policy import Decision, guardrails
from medic.store import utcnow
from tasks.evidence import fleet_state
from tasks.runtime import Runtime

NODE_ACTIONS_LIMIT = "medic-node-actions"
_ensured: set[str] = set()


async def ensure_limits() -> None:
    """Create the limit once per process and API (upsert: safe to race with other processes)."""
    async with get_client() as client:
        key = str(client.api_url)
        if key in _ensured:
            return
        await client.upsert_global_concurrency_limit_by_name(NODE_ACTIONS_LIMIT, 1)
        _ensured.add(key)


@contextmanager
def guarded(rt: Runtime, node: str, decision: Decision) -> Iterator[tuple[str, str] | None]:
    """Yield the guardrail the action would now break (None: go ahead) while holding the slot."""

    def recheck() -> tuple[str, str] | None:
        policy = rt.policy().policy
        state = fleet_state(rt, policy, utcnow(), rt.backends.scheduler.nodes())
        return guardrails.check(policy.guardrails, state, node, decision)

    if flow_run.id is None:  # called directly (tests, benchmarks): one process, nothing to race
        yield recheck()
        return
    with concurrency(NODE_ACTIONS_LIMIT, occupy=1, strict=True, timeout_seconds=600):
        yield recheck()
