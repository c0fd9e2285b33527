"""`medic demo`: a simulated 12-node fleet, a few real-looking faults, the real flows end to end.

The flows and the Prefect runner are imported inside `demo`: the rest of the CLI, `--help`
included, must not pay Prefect's import.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any
from uuid import UUID

import typer
from rich.table import Table

from medic.apps.cli import demo_sweep, render
from medic.apps.cli._common import console, load_policy_or_exit
from medic.apps.cli.demo_job import DemoJob
from medic.config import load_settings
from medic.events import event_time
from medic.intake import read_lines
from medic.integrations import registry
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.sim.notifier import RecordingNotifier
from medic.policy import LoadedPolicy
from medic.protocols import Message
from medic.store import Store
from medic.tasks.runtime.process import Runtime, configure

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
    job: DemoJob  # reports as it runs: it answers GPU Medic's profile requests


def _event(n: int, at: datetime, kind: str, node: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": f"demo-{n:03d}",
        "time": event_time(at),
        "source": fields.pop("source", "agent"),
        "kind": kind,
        "node": node,
        **fields,
    }


def build_scenario(artifacts: Path, now: datetime | None = None) -> Scenario:
    """The fleet, its jobs, scripted diagnostics, and the event lines the faults produce; the
    training job's ranks keep their files under `artifacts` (under MEDIC_ARTIFACT_ROOT)."""
    t0 = (now or datetime.now(UTC)) - timedelta(minutes=3)
    fleet = _demo_fleet()
    lines = [json.dumps(e) for e in _fault_events(fleet, t0)]
    lines[3:3] = BAD_LINES
    fleet.crash_job("llm-pretrain")
    fleet.crash_job("vision-ft")
    # The job's ranks report their step timings every 10 steps from t0 + 72 s (demo_job.py): rank 1's
    # own work (before its first collective) takes 42% longer than its peers', which peer comparison
    # names; GPU Medic then asks rank 1 and a healthy peer for a profile of the same steps.
    job = DemoJob(
        name="llm-pretrain",
        nodes=[f"gpu-node-{i}" for i in (1, 2, 3, 4)],
        switches={f"gpu-node-{i}": fleet.node(f"gpu-node-{i}").switch for i in (1, 2, 3, 4)},
        folder=artifacts / "llm-pretrain",
        start=t0 + timedelta(seconds=72),
        first_step=12_310,
        windows=4,
        slow_rank=1,
        gpu=2,
    )
    return Scenario(fleet, lines, list(STORY), job)


def _demo_fleet() -> SimFleet:
    """Twelve nodes of 8 GPUs, four to a leaf switch, two training jobs, and one degraded GPU."""
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

    return fleet


def _fault_events(fleet: SimFleet, t0: datetime) -> list[dict[str, Any]]:
    """The events the demo's faults produce, from `t0` on (the straggler's are its job's own)."""
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
    # 3. DCGM's health watch on gpu-node-2 flags low memory bandwidth (TRIAGE), and the job's step
    #    timings name rank 1 there as the straggler; its profile blames the device: DCGM level 2 first.
    add(
        90,
        "dcgm_health",
        "gpu-node-2",
        gpu=2,
        source="dcgm",
        attributes={"error_id": "DCGM_FR_MEMORY_BANDWIDTH"},
    )
    # 4. A lone collective timeout on gpu-node-7: a quick DCGM level 1 settles it (passes).
    add(150, "nccl_timeout", "gpu-node-7", job="vision-ft", rank=3, source="job")
    # 5. Every node under leaf-3 times out at once: the switch's trouble, one incident, no node touched.
    for second in range(3):
        for node in range(9, 13):
            add(160 + second + node / 10, "nccl_timeout", f"gpu-node-{node}", job="eval-sweep", source="job")

    return events


# What the demo's faults are, as its banner tells them.
STORY = (
    "gpu-node-3: XID 79 (GPU fallen off the bus), the training job's ranks time out and crash",
    "gpu-node-5: NaN loss at iteration 8,215 in vision-ft, then the job crashes",
    "gpu-node-2: DCGM's health watch flags low memory bandwidth on GPU 2; comparing the job's ranks"
    " with their peers names rank 1 there as the straggler; its profile against a healthy peer's"
    " (real traces of the reference job, one recorded with a slowed compute op) blames the device,"
    " so the diagnostics start at DCGM level 2",
    "gpu-node-7: a lone NCCL timeout; its group, canary, is in observe mode: GPU Medic only says what it"
    " would do",
    "leaf-3: all four nodes under the switch report NCCL timeouts at once",
    "two malformed lines in the feed",
)


# Beside the nodes GPU Medic remediates, two it only watches, as a rollout starts (docs/policy.md#groups-and-modes).
DEMO_GROUPS = """
# Added by `medic demo`: two nodes watched only, beside the rest of the fleet remediated.
groups:
  - name: canary
    description: Watched only while GPU Medic earns its trust
    select: {hostlist: ["gpu-node-[7-8]"]}
    mode: observe
"""


def demo_policy(loaded: LoadedPolicy, home: Path) -> Path:
    """The policy in force with the demo's observed group, unless it has groups of its own."""
    if loaded.policy.groups:
        return Path(loaded.path)
    path = home / "demo-policy.yaml"
    path.write_bytes(Path(loaded.path).read_bytes() + DEMO_GROUPS.encode())
    return path


# How long the demo's approver waits for a run to pause for its answer.
PAUSE_WAIT_S = 60.0
DEMO_ANSWER = {
    "approved": True,
    "by": "demo",
    "via": "demo",
    "comment": "medic demo answers its own approval requests",
}


class DemoApprover:
    """The people in Slack, played by the demo: it records messages as the simulated notifier
    does, and answers each approval request as a click would, through Prefect's
    `resume_flow_run` with the typed input the flow waits for (medic/flows/approval.py)."""

    def __init__(self, recorder: RecordingNotifier) -> None:
        self.recorder = recorder
        self.answered: list[str] = []

    def post(self, message: Message) -> str:
        ref = self.recorder.post(message)
        if message.approval_run:
            threading.Thread(target=self._approve, args=(message,), daemon=True).start()
        return ref

    def reply(self, thread: str, text: str) -> None:
        self.recorder.reply(thread, text)

    def _approve(self, message: Message) -> None:
        from prefect.flow_runs import resume_flow_run

        assert message.approval_run is not None
        run_id = UUID(message.approval_run)
        deadline = time.monotonic() + PAUSE_WAIT_S
        while not asyncio.run(_is_paused(run_id)):  # the request goes out just before the pause
            if time.monotonic() > deadline:
                console.print(f"[red]the demo's approver gave up: {message.title} never paused[/red]")
                return
            time.sleep(0.2)
        resume_flow_run(run_id, run_input=DEMO_ANSWER)
        self.answered.append(message.title)
        console.print(f"[bold green]approved by demo[/bold green]: {message.title} ({message.incident})")


async def _is_paused(run_id: UUID) -> bool:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        run = await client.read_flow_run(run_id)
    return bool(run.state and run.state.is_paused())


def simulated_backends(scenario: Scenario) -> tuple[registry.Backends, RecordingNotifier]:
    """The simulated backends, with the demo's approver in place of the people in Slack."""
    backends, _ = registry.simulated(scenario.fleet)
    assert isinstance(backends.notifier, RecordingNotifier)
    recorder = backends.notifier
    backends.notifier = DemoApprover(recorder)
    return backends, recorder


def write_events(lines: list[str], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def stage_columns() -> Iterator[str]:
    yield from ("triage", "diagnose", "decide", "approval", "act", "resume job", "verify", "notify", "close")


def _stage_times(store: Store, incident_ids: list[str]) -> Table:
    columns = list(stage_columns())
    table = Table(title="Seconds per stage", title_justify="left")
    table.add_column("incident")
    for column in columns:
        table.add_column(column, justify="right")
    for incident_id in incident_ids:
        detail = store.incident_detail(incident_id)
        spent = dict.fromkeys(columns, 0.0)
        for step in detail.steps if detail else ():
            key = next((c for c in columns if step.stage.startswith(c.split()[0])), None)
            if key:
                spent[key] += (step.finished_at - step.started_at).total_seconds()
        table.add_row(incident_id, *(f"{spent[c]:.3f}" if spent[c] else "-" for c in columns))
    return table


def demo(
    keep: Annotated[bool, typer.Option(help="Keep the demo's earlier incidents in the store.")] = False,
) -> None:
    """Run a simulated 8-node fleet through real Prefect flows (no servers to set up)."""
    from medic.apps.cli.demo_job import through_differential
    from medic.apps.cli.prefect_run import run_flows
    from medic.flows.dispatch import remediate_all

    settings = load_settings()
    database = settings.home / "demo.db"
    if not keep:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{database}{suffix}").unlink(missing_ok=True)
    scenario = build_scenario(settings.artifact_root / "demo")
    backends, notifier = simulated_backends(scenario)
    loaded = load_policy_or_exit(None)
    store = Store(f"sqlite:///{database}")
    policy = demo_policy(loaded, settings.home)
    rt = configure(Runtime(store, backends, policy, settings.artifact_root))

    console.rule("[bold]GPU Medic demo[/bold]: 8 simulated nodes, 2 training jobs")
    for line in scenario.story:
        console.print(f"  • {line}")
    console.print('  • the policy asks a human before replacing a node: the demo answers as one ("demo")')
    events_file = settings.home / "demo-events.jsonl"
    console.print(f"[dim]events: {events_file}; store: {database}; policy: {policy}[/dim]\n")
    serve = functools.partial(through_differential, job=scenario.job, root=settings.artifact_root)
    intake = read_lines(scenario.lines, events_file.name, diagnose=serve)
    # The file holds what the feed held: the job's reports too, for `medic triage` to read again.
    write_events(scenario.lines + [e.model_dump_json() for e in scenario.job.emitted], events_file)
    dispatch = run_flows(remediate_all(rt, intake))

    console.print(render.rejections_table(intake.rejected))
    console.print(render.incidents_table(store.get_incidents([i.id for i in dispatch.incidents])))
    outcomes = Table(title="Outcomes", title_justify="left")
    for column in ("incident", "node", "diagnostics", "outcome"):
        outcomes.add_column(column, overflow="fold")
    for o in dispatch.outcomes:
        outcomes.add_row(o.incident, o.node, ", ".join(o.diagnostics) or "-", o.summary)
    console.print(outcomes)
    console.print(_stage_times(store, [i.id for i in dispatch.incidents]))
    run_flows(demo_sweep.run(rt, scenario.fleet))
    console.rule("Messages for the owners")
    for thread in notifier.threads.values():
        console.print(render.message_panel(thread.message, thread.replies))
    console.print(
        "\nNext: [bold]prefect flow-run ls[/bold] shows the runs; "
        f"[bold]MEDIC_DATABASE_URL=sqlite:///{database} medic incident <id>[/bold] shows one step by step, "
        "and [bold]medic report --html report.html[/bold] with the same variable the post-mortem."
    )
    if dispatch.failed:
        raise typer.Exit(1)
