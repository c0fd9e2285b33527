"""Unfinished action intents are settled by asking the provider's own record (here the simulator's boot
time; tests/system/test_slurm.py, test_ec2.py and test_hyperpod.py settle on the real ones)."""

from __future__ import annotations

from medic.integrations.sim.fleet import SimFleet
from medic.tasks.nodes.reconcile import reconcile_intents
from medic.tasks.runtime.process import Runtime


def test_a_reboot_that_happened_is_marked_done(runtime: Runtime, fleet: SimFleet) -> None:
    runtime.store.claim_action("inc-1:gpu-node-1:reboot", "inc-1", "gpu-node-1", "reboot")
    runtime.backends.provider.reboot("gpu-node-1")  # the call went through; the process then died
    (settled,) = reconcile_intents(runtime)
    assert settled.startswith("inc-1:gpu-node-1:reboot: done (gpu-node-1 booted at ")
    row = runtime.store.get_action("inc-1:gpu-node-1:reboot")
    assert row is not None and row.status == "succeeded" and "reconciled" in row.detail


def test_a_reboot_that_never_happened_may_be_retried(runtime: Runtime, fleet: SimFleet) -> None:
    runtime.backends.provider.reboot("gpu-node-2")  # an older boot
    runtime.store.claim_action("inc-2:gpu-node-2:reboot", "inc-2", "gpu-node-2", "reboot")
    (settled,) = reconcile_intents(runtime)
    assert settled.startswith("inc-2:gpu-node-2:reboot: not done (gpu-node-2 has not booted since the intent")
    row = runtime.store.get_action("inc-2:gpu-node-2:reboot")
    assert row is not None and row.status == "failed"


def test_what_the_backend_cannot_tell_stays_an_intent(runtime: Runtime, fleet: SimFleet) -> None:
    runtime.store.claim_action("inc-3:gpu-node-3:reset_gpu", "inc-3", "gpu-node-3", "reset_gpu")
    runtime.store.claim_action("inc-3:gpu-node-4:reboot", "inc-3", "gpu-node-4", "reboot")  # never booted
    assert reconcile_intents(runtime) == []
    assert {a.key for a in runtime.store.unfinished_actions()} == {
        "inc-3:gpu-node-3:reset_gpu",
        "inc-3:gpu-node-4:reboot",
    }
