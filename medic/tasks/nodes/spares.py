"""The spare pool in a remediation (docs/spares.md): a spare lent when a job is moved off a node that
must go, so that the requeued job starts again at once; a repaired node, verified, refilling the pool
while it is short of the policy's `spares.nodes`. Each at most once per incident and node, under a
claim in the store like every node action. Neither stops the repair when it fails: it says why."""

from __future__ import annotations

from medic.statuses import ActionStatus
from medic.tasks.runtime.process import Runtime

LEND = "lend_spare"  # the actions' names in the store
REFILL = "refill_spares"


def lend_spare(rt: Runtime, incident_id: str, node: str) -> str:
    """Lend a spare for the jobs just moved off `node`; what happened, or "" with no pool to lend from."""
    pool = rt.backends.spare_pool
    if pool is None or rt.policy().policy.spares.nodes == 0:
        return ""
    key = f"{incident_id}:{node}:{LEND}"
    # Lent for this incident already (the flow lends before its verification starts, the job's
    # requeue asks again): what came of it; nothing after a run that died. Never a second one, not
    # even after an empty pool: a failed claim may be taken again, and by then the repaired node
    # may have refilled the pool and would be lent to the job it was taken off.
    row, claimed = rt.store.get_action(key), False
    if row is None:
        row, claimed = rt.store.claim_action(key, incident_id, node, LEND)
    if not claimed:
        return row.detail if row.status in (ActionStatus.SUCCEEDED, ActionStatus.FAILED) else ""
    try:
        lent = pool.lend()
    except Exception as error:  # the repair goes on; the job waits for a free node instead
        said = f"no spare lent: {error}"
        rt.store.finish_action(key, ActionStatus.FAILED, said)
        return said
    if lent is None:
        said = "no spare lent: the pool is empty, so the job waits for a free node"
        rt.store.finish_action(key, ActionStatus.FAILED, said)
        return said
    said = f"spare {lent} lent to the job"
    rt.store.finish_action(key, ActionStatus.SUCCEEDED, said)
    return said


def refill_spares(rt: Runtime, incident_id: str, node: str) -> str | None:
    """Put the verified `node` in the pool while it is short, before it is resumed, so that no job lands
    on it meanwhile; None when the pool is full or there is none (the node returns to general service)."""
    pool = rt.backends.spare_pool
    wanted = rt.policy().policy.spares.nodes
    if pool is None or wanted == 0:
        return None
    have = pool.spare_nodes()
    if node in have or len(have) >= wanted:
        return None
    key = f"{incident_id}:{node}:{REFILL}"
    _, claimed = rt.store.claim_action(key, incident_id, node, REFILL)
    if not claimed:
        return None
    try:
        pool.refill(node)
    except Exception as error:  # it returns to general service instead
        rt.store.finish_action(key, ActionStatus.FAILED, f"{type(error).__name__}: {error}")
        return f"{node} not put in the spare pool: {error}"
    rt.store.finish_action(key, ActionStatus.SUCCEEDED, f"{node} put in the spare pool")
    return f"{node} refills the spare pool ({len(have) + 1} of {wanted})"
