"""The act stage's `reset_gpu`, run for real on Prefect (test harness) over the simulated fleet: the GPU
is reset in place where a `GpuReset` is configured, the node is rebooted instead when the reset is
not done (and the step says why), and the provider's own `reset_gpu` (a reboot) where none is. A
reset whose outcome a crash lost is never settled as "not done" from the absence of a boot."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from checkout import REPO_ROOT
from factories import fault_event

from medic.flows.dispatch import Dispatch, remediate_all
from medic.intake import read_lines
from medic.integrations.registry import Backends
from medic.integrations.settling import booted_since, not_booted
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.sim.provider import SimProvider
from medic.protocols import Settled
from medic.store import Store
from medic.tasks.nodes.reconcile import reconcile_intents
from medic.tasks.runtime.process import Runtime, configure

pytestmark = pytest.mark.usefixtures("prefect_harness")

NODE = "gpu-node-1"
T0 = datetime.now(UTC) - timedelta(minutes=5)


@pytest.fixture
def runtime(sqlite_store: Store, sim_backends: Backends) -> Runtime:
    """One store is enough: nothing here is the database's (the act stage's store code runs on both
    in test_flow.py)."""
    return configure(Runtime(sqlite_store, sim_backends, REPO_ROOT / "policies" / "default.yaml"))


def double_bit_ecc(rt: Runtime) -> Dispatch:
    """XID 48, which NVIDIA's catalog resolves with a GPU reset (the default policy's xid-reset-gpu)."""
    event = fault_event("xid", id="ev-48", node=NODE, at=T0, gpu=2, attributes={"code": 48})
    return asyncio.run(remediate_all(rt, read_lines([event.model_dump_json()], "test.jsonl")))


def act_detail(rt: Runtime, dispatch: Dispatch) -> str:
    (outcome,) = dispatch.outcomes
    assert outcome.action == "reset_gpu"
    detail = rt.store.incident_detail(outcome.incident)
    assert detail is not None
    (step,) = [s for s in detail.steps if s.stage == "act: reset_gpu"]
    return step.summary


def test_the_gpu_is_reset_in_place_and_the_node_never_rebooted(runtime: Runtime, fleet: SimFleet) -> None:
    dispatch = double_bit_ecc(runtime)
    assert f"reset GPU 2 on {NODE}" in act_detail(runtime, dispatch)
    assert [a for n, a in fleet.calls if n == NODE and a in ("reset_gpu", "reboot")] == ["reset_gpu"]
    assert (fleet.node(NODE).gpu_resets, fleet.node(NODE).boots) == (1, 0)
    (outcome,) = dispatch.outcomes
    assert outcome.verified is not None and outcome.verified.passed


def test_a_reset_that_is_not_done_becomes_a_reboot_that_says_why(runtime: Runtime, fleet: SimFleet) -> None:
    fleet.reset_refusals[NODE] = "pid 4242 (python) holds GPU 2"
    dispatch = double_bit_ecc(runtime)
    detail = act_detail(runtime, dispatch)
    assert (
        f"GPU reset not done (GPU 2 not reset: pid 4242 (python) holds GPU 2); rebooting instead: rebooted {NODE}"
        in detail
    )
    assert (fleet.node(NODE).gpu_resets, fleet.node(NODE).boots) == (0, 1)
    (outcome,) = dispatch.outcomes
    assert outcome.verified is not None and outcome.verified.passed  # the reboot came back and passed


def test_without_a_gpu_reset_the_providers_own_is_used(runtime: Runtime, fleet: SimFleet) -> None:
    runtime.backends.gpu_reset = None
    dispatch = double_bit_ecc(runtime)
    assert act_detail(runtime, dispatch).endswith(f"reset GPU 2 on {NODE}")
    assert [a for n, a in fleet.calls if n == NODE and a == "reset_gpu"] == ["reset_gpu"]


class BootRecordProvider(SimProvider):
    """Settles every action from the node's boot record, as Slurm's and EC2's providers do."""

    def settle(self, node: str, action: str, since: datetime) -> Settled | None:
        booted = self.booted_at(node)
        return None if booted is None else booted_since(node, booted, since) or not_booted(node, booted)


def test_a_lost_reset_is_not_called_undone_for_want_of_a_boot(runtime: Runtime, fleet: SimFleet) -> None:
    runtime.backends.provider = BootRecordProvider(fleet)
    runtime.backends.provider.reboot(NODE)  # a boot before the intent
    key = f"inc-r:{NODE}:reset_gpu"
    runtime.store.claim_action(key, "inc-r", NODE, "reset_gpu")
    assert reconcile_intents(runtime) == []  # a reset leaves no boot: it may have happened
    assert [a.key for a in runtime.store.unfinished_actions()] == [key]

    runtime.backends.gpu_reset = None  # reset_gpu is then the provider's reboot: its boot record tells
    (settled,) = reconcile_intents(runtime)
    assert settled.startswith(f"{key}: not done ({NODE} has not booted since the intent")
