"""The flows and the policy file: reloaded per incident, broken edits refused, guardrails held."""

from __future__ import annotations

import asyncio
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from checkout import REPO_ROOT
from factories import fault_event

from medic.flows.dispatch import Dispatch, remediate_all
from medic.intake import read_lines
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.sim.notifier import RecordingNotifier
from medic.tasks.runtime.process import Runtime

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"

pytestmark = pytest.mark.usefixtures("prefect_harness")


def line(name: str, kind: str, node: str, seconds_ago: float = 1, **fields: Any) -> str:
    at = datetime.now(UTC)
    return fault_event(kind, id=name, node=node, at=at, seconds=-seconds_ago, **fields).model_dump_json()


def run(rt: Runtime, lines: list[str]) -> Dispatch:
    return asyncio.run(remediate_all(rt, read_lines(lines, "t.jsonl")))


@pytest.fixture
def editable(runtime: Runtime, tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    shutil.copy(DEFAULT_POLICY, path)
    runtime.policy_path = path
    return path


def test_an_edit_applies_to_the_next_incident(runtime: Runtime, editable: Path, fleet: SimFleet) -> None:
    (first,) = run(runtime, [line("a", "xid", "gpu-node-1", attributes={"code": 48})]).outcomes
    assert first.action == "reset_gpu"
    editable.write_text(editable.read_text().replace("      action: reset_gpu\n", "      action: drain\n", 1))
    (second,) = run(runtime, [line("b", "xid", "gpu-node-2", attributes={"code": 48})]).outcomes
    assert (second.action, second.rule) == ("drain", "xid-reset-gpu")


def test_a_broken_edit_is_refused_and_the_owner_told(
    runtime: Runtime, editable: Path, fleet: SimFleet
) -> None:
    run(runtime, [line("a", "xid", "gpu-node-1", attributes={"code": 48})])
    editable.write_text(editable.read_text().replace("action: reboot", "action: rebooot", 1))
    (outcome,) = run(runtime, [line("b", "xid", "gpu-node-2", attributes={"code": 79})]).outcomes
    assert outcome.action == "reboot"  # the last good policy is still in force
    notifier = runtime.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    last = list(notifier.threads.values())[-1].message
    assert "policy edit refused" in last.body and "rebooot" in last.body


def test_breaker_opens_on_a_storm_and_stays_open_until_closed(runtime: Runtime, fleet: SimFleet) -> None:
    storm = [line(f"s{i}", "xid", f"gpu-node-{i}", attributes={"code": 79}) for i in (1, 2, 3, 4)]
    outcomes = {o.node: o for o in run(runtime, storm).outcomes}
    # 25% of 8 nodes: two nodes may be taken out within 5 minutes, the third trips the breaker.
    assert [outcomes[f"gpu-node-{i}"].action for i in (1, 2, 3, 4)] == [
        "reboot",
        "reboot",
        "escalate",
        "escalate",
    ]
    assert fleet.nodes["gpu-node-3"].boots == 0 and fleet.nodes["gpu-node-4"].boots == 0
    breaker = runtime.store.open_breaker_record()
    assert breaker is not None and "3 nodes taken out" in breaker.reason
    # Reintegration is never held back by the open breaker.
    fleet.nodes["gpu-node-5"].state = fleet.nodes["gpu-node-5"].state.DRAINED
    fleet.nodes["gpu-node-5"].reason = "medic: earlier incident"
    (back,) = run(
        runtime, [line("p", "diagnostic", "gpu-node-5", attributes={"level": 1, "result": "pass"})]
    ).outcomes
    assert (back.action, back.act) == ("reintegrate", "done")
    runtime.store.close_breaker("alice")
    assert runtime.store.open_breaker_record() is None


def test_network_storm_touches_no_node(runtime: Runtime, fleet: SimFleet) -> None:
    # gpu-node-1..4 hang off leaf-1 in the simulated fleet.
    timeouts = [
        line(f"n{i}", "nccl_timeout", f"gpu-node-{i}", switch="leaf-1", job="llm", rank=i)
        for i in (1, 2, 3, 4)
    ]
    outcomes = run(runtime, timeouts).outcomes
    assert outcomes[-1].classification == "infrastructure" and outcomes[-1].rule == "network-switch-storm"
    assert not [c for c in fleet.calls if c[1] in ("drain", "reboot", "replace", "reset_gpu")]
    notifier = runtime.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    assert list(notifier.threads.values())[-1].message.channel == "#network-oncall"
