"""`medic demo`: a simulated 12-node fleet, a few real-looking faults, the real flows end to end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from integrations import registry
from integrations.sim.fleet import SimFleet
from integrations.sim.notifier import RecordingNotifier
from medic.events import event_time

# Extra lines a real feed would contain too: they must be rejected, kept, and not stop the rest.
BAD_LINES = (
    '{"id": "bad-1", "time": "2026-11-22T10:00:00Z", "source": "agent", "kind": "xid", "node": "gpu-node-4"}',
    '{"id": "bad-2", "time": "yesterday", "source": "agent", "kind": "flux_capacitor", "node": "gpu-node-4"}',
)


@dataclass(frozen=True, slots=True)
class Scenario:
    fleet: SimFleet
    lines: list[str]
    story: list[str]


def _event(n: int, at: datetime, kind: str, node: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": f"demo-{n:03d}",
        "time": event_time(at),
        "source": fields.pop("source", "agent"),
        "kind": kind,
        "node": node,
        **fields,
    }


def build_scenario(now: datetime | None = None) -> Scenario:
    """The fleet, its jobs, scripted diagnostics, and the event lines the faults produce."""
    t0 = (now or datetime.now(UTC)) - timedelta(minutes=3)
    fleet = SimFleet.build(nodes=12, gpus=8, per_switch=4)
    fleet.add_job(
        "llm-pretrain",
        "alice",
        [f"gpu-node-{i}" for i in (1, 2, 3, 4)],
        step=12_340,
        checkpoint_every=500,
        step_seconds=1.8,
    )
    fleet.add_job(
        "vision-ft",
        "bob",
        ["gpu-node-5", "gpu-node-6", "gpu-node-7"],
        step=8_215,
        checkpoint_every=200,
        step_seconds=0.9,
    )
    # The degraded GPU on gpu-node-2 passes the quick check; only DCGM level 2's memory test finds it.
    fleet.script_diagnostic("gpu-node-2", 2, "fail", ("DCGM_FR_FAULTY_MEMORY",))

    events: list[dict[str, Any]] = []

    def add(offset_s: float, kind: str, node: str, **fields: Any) -> None:
        switch = fleet.node(node).switch
        events.append(
            _event(len(events) + 1, t0 + timedelta(seconds=offset_s), kind, node, switch=switch, **fields)
        )

    # 1. XID 79 on gpu-node-3: the GPU fell off the bus; the job's ranks time out and crash.
    add(0, "xid", "gpu-node-3", gpu=5, attributes={"code": 79, "message": "GPU has fallen off the bus."})
    add(0.4, "xid", "gpu-node-3", gpu=5, attributes={"code": 79})
    for rank in (8, 9, 10):
        add(30 + rank, "nccl_timeout", "gpu-node-3", job="llm-pretrain", rank=rank, source="job")
    add(
        45, "job_crash", "gpu-node-3", job="llm-pretrain", rank=8, source="job", attributes={"exit_code": 134}
    )
    # 2. NaN loss in vision-ft: the application's fault; the node is left alone.
    add(60, "nan_loss", "gpu-node-5", job="vision-ft", rank=0, iteration=8_215, source="job")
    add(61, "job_crash", "gpu-node-5", job="vision-ft", rank=0, source="job", attributes={"exit_code": 1})
    # 3. DCGM's health watch on gpu-node-2 flags low memory bandwidth (TRIAGE): the ladder climbs.
    add(
        90,
        "dcgm_health",
        "gpu-node-2",
        gpu=2,
        source="dcgm",
        attributes={"error_id": "DCGM_FR_MEMORY_BANDWIDTH"},
    )
    add(
        110,
        "straggler",
        "gpu-node-2",
        job="llm-pretrain",
        rank=4,
        gpu=2,
        source="job",
        attributes={"step_time_ratio": 1.42},
    )
    # 4. A lone collective timeout on gpu-node-7: a quick DCGM level 1 settles it (passes).
    add(150, "nccl_timeout", "gpu-node-7", job="vision-ft", rank=3, source="job")
    # 5. Every node under leaf-3 times out at once: the switch's trouble, one incident, no node touched.
    for second in range(3):
        for node in range(9, 13):
            add(160 + second + node / 10, "nccl_timeout", f"gpu-node-{node}", job="eval-sweep", source="job")

    lines = [json.dumps(e) for e in events]
    lines[3:3] = BAD_LINES
    fleet.crash_job("llm-pretrain")
    fleet.crash_job("vision-ft")
    story = [
        "gpu-node-3: XID 79 (GPU fallen off the bus), the training job's ranks time out and crash",
        "gpu-node-5: NaN loss at iteration 8,215 in vision-ft, then the job crashes",
        "gpu-node-2: DCGM's health watch flags low memory bandwidth on GPU 2; the job's steps slow down",
        "gpu-node-7: a lone NCCL timeout",
        "leaf-3: all four nodes under the switch report NCCL timeouts at once",
        "two malformed lines in the feed",
    ]
    return Scenario(fleet, lines, story)


def simulated_backends(scenario: Scenario) -> tuple[registry.Backends, RecordingNotifier]:
    backends, _ = registry.simulated(scenario.fleet)
    assert isinstance(backends.notifier, RecordingNotifier)
    return backends, backends.notifier


def write_events(lines: list[str], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def stage_columns() -> Iterator[str]:
    yield from ("triage", "diagnose", "decide", "act", "resume job", "verify", "notify", "close")
