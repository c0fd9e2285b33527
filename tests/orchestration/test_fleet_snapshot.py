"""The fleet snapshot decisions count from (medic/tasks/runtime/fleet_snapshot.py, decision 0023): one read of the
scheduler serves a process's decisions for a few seconds, and every node GPU Medic meant to take
out since that read counts as out of service, from the store, wherever it was recorded, until it
is returned. The last check under the guardrail slot still reads the scheduler itself
(tests/orchestration/test_out_of_service_slot.py, test_contain.py)."""

from __future__ import annotations

import threading
import time

from medic.policy import load_policy
from medic.protocols import NodeInfo
from medic.statuses import ActionStatus
from medic.store import utcnow
from medic.tasks.nodes.evidence import fleet_state
from medic.tasks.runtime.fleet_snapshot import FleetNodes
from medic.tasks.runtime.process import Runtime


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_read_serves_the_decisions_until_it_is_old() -> None:
    reads: list[int] = []
    clock = Clock()

    def read() -> list[NodeInfo]:
        reads.append(1)
        time.sleep(0.05)  # a scheduler read takes a while: the threads below arrive during it
        return []

    fleet = FleetNodes(read, max_age_s=5.0, clock=clock)
    threads = [threading.Thread(target=fleet.get) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(reads) == 1  # eight decisions at once, one read
    first = fleet.get()
    clock.now = 4.9
    assert fleet.get() is first and len(reads) == 1
    clock.now = 5.0
    assert fleet.get() is not first and len(reads) == 2


def test_a_node_taken_out_after_the_snapshot_counts_from_the_store(runtime: Runtime) -> None:
    policy = load_policy(runtime.policy_path).policy
    snapshot = runtime.fleet()
    # Another replica drains gpu-node-2 under the slot: its drain is in the shared store at once,
    # and its intent counts even before (or without) an outcome: it may have happened.
    runtime.store.claim_action("inc-b:gpu-node-2:drain", "inc-b", "gpu-node-2", "drain")
    runtime.backends.scheduler.drain("gpu-node-2", "medic: incident inc-b")
    # Someone else drains gpu-node-3: the scheduler shows it, the snapshot does not yet.
    runtime.backends.scheduler.drain("gpu-node-3", "admin: RMA 4711")
    # And one we took out and gave back since: out and in again, not counted.
    runtime.store.claim_action("inc-c:gpu-node-4:drain", "inc-c", "gpu-node-4", "drain")
    runtime.store.claim_action("inc-c:gpu-node-4:resume", "inc-c", "gpu-node-4", "resume")
    runtime.store.finish_action("inc-c:gpu-node-4:resume", ActionStatus.SUCCEEDED, "resumed gpu-node-4")
    state = fleet_state(runtime, policy, utcnow(), snapshot.nodes, since=snapshot.read_at)
    assert state.out_of_service == {"gpu-node-2"}
    # Without `since` (the snapshot taken as it is) only the scheduler's word at the read counts.
    assert fleet_state(runtime, policy, utcnow(), snapshot.nodes).out_of_service == set()
    # A fresh read counts both.
    nodes = runtime.backends.scheduler.nodes()
    assert fleet_state(runtime, policy, utcnow(), nodes, since=utcnow()).out_of_service == {
        "gpu-node-2",
        "gpu-node-3",
    }
