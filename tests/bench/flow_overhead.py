"""Per-incident overhead of the Prefect flow over calling the same task functions directly.

Runs in its own process (`PYTHONPATH=tests python -m bench.flow_overhead OUT.json`) so that PREFECT_HOME points at
a fresh temporary directory before anything imports Prefect. In that process:

(b) direct: `remediate_direct` mirrors medic/flows/remediate.py stage by stage but calls each task's
    undecorated function (`triage.fn`, `decide_incident.fn`, `act.fn`, `resume_job.fn`,
    `verify.fn`, `notify.fn`, `close.fn`), with its own simulated fleet and SQLite store;
(a) flow: the real `remediate` flow per incident on the ephemeral Prefect server, with a fresh
    fleet and store. The first run (which starts the temporary server) is reported on its own.

Every incident is an XID 79 on a distinct node that runs a 2-node job, so the full path
act (drain + reboot) → resume job → verify (DCGM L1 + resume node) → notify → close runs.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench import IMPORT_ROOT, REPO_ROOT
from bench.report import Stats, ms, num, table

INCIDENTS = 20
TASK_RUNS = 7  # per incident on this path: triage, decide, act, resume job, verify, notify, close
POLICY = REPO_ROOT / "policies" / "default.yaml"


def policy_without_guardrails(directory: Path) -> Path:
    """The default policy without its guardrails: twenty reboots in seconds are a storm the
    breaker (rightly) stops, and this measures the flow, not the guardrails."""
    import yaml

    data = yaml.safe_load(POLICY.read_text(encoding="utf-8"))
    data["guardrails"] = {}
    path = directory / "policy.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _scenario(count: int, tag: str) -> tuple[Any, list[str]]:
    """A fleet with `count` 2-node jobs plus spares, and event lines: one XID 79 burst per job's first node."""
    from medic.integrations.sim.fleet import SimFleet

    fleet = SimFleet.build(nodes=2 * count + 4)
    now = datetime.now(UTC) - timedelta(minutes=2)
    lines = []
    for i in range(count):
        first, second = f"gpu-node-{2 * i + 1}", f"gpu-node-{2 * i + 2}"
        job = f"train-{i:02d}"
        fleet.add_job(
            job, f"owner-{i % 3}", [first, second], step=1234, checkpoint_every=100, step_seconds=1.5
        )
        fleet.crash_job(job)
        base = {"source": "agent", "node": first, "switch": fleet.node(first).switch}
        for n, (kind, extra) in enumerate(
            [
                ("xid", {"gpu": 5, "attributes": {"code": 79, "message": "GPU has fallen off the bus."}}),
                ("xid", {"gpu": 5, "attributes": {"code": 79}}),
                ("job_crash", {"job": job, "rank": 8, "source": "job", "attributes": {"exit_code": 134}}),
            ]
        ):
            at = (now + timedelta(seconds=i + n * 0.1)).isoformat()
            lines.append(json.dumps({**base, "id": f"{tag}-{i}-{n}", "time": at, "kind": kind, **extra}))
    return fleet, lines


def _setup(count: int, tag: str, directory: Path) -> tuple[Any, list[Any]]:
    """A fresh store, fleet and Runtime (configured as current), with the incidents recorded."""
    from medic.flows.dispatch import record
    from medic.intake import read_lines
    from medic.integrations import registry
    from medic.store import Store
    from medic.tasks.runtime.process import Runtime, configure

    fleet, lines = _scenario(count, tag)
    backends, _ = registry.simulated(fleet)
    store = Store(f"sqlite:///{directory / f'{tag}.db'}")
    rt = configure(Runtime(store, backends, policy_without_guardrails(directory)))
    dispatch = record(rt, read_lines(lines, f"{tag}.jsonl"))
    assert len(dispatch.incidents) == count, dispatch
    return rt, dispatch.incidents


def remediate_direct(incident_id: str, node: str) -> Any:
    """medic/flows/remediate.py's `remediate`, stage for stage, with Prefect bypassed (task `.fn`s)."""
    from medic.audit import incident_markdown
    from medic.flows.ladder import MAX_STEPS
    from medic.flows.remediate import closing_status, first_message, outcome_of, summary_of
    from medic.policy import Action
    from medic.policy.model import DESTRUCTIVE
    from medic.tasks.act import ActOutcome, act
    from medic.tasks.close import close
    from medic.tasks.decide import decide_incident
    from medic.tasks.diagnose import diagnose
    from medic.tasks.resume import resume_job
    from medic.tasks.runtime.process import current
    from medic.tasks.triage import triage
    from medic.tasks.verify import verify

    triaged = triage.fn(incident_id)
    decision, seen = triaged.decision, []
    notifier = current().backends.notifier  # the flow queues these for its notification worker
    thread = notifier.post(first_message(triaged, decision, current().store.incident_events(incident_id)))
    for _ in range(MAX_STEPS):  # diagnose_ladder
        if decision.action is not Action.DIAGNOSE or decision.diagnose_level is None:
            break
        result = diagnose.fn(triaged.incident, triaged.node, decision.diagnose_level)
        seen.append(f"L{result.level} {result.result}")
        if result.result == "error":
            decision = decision.model_copy(update={"action": Action.ESCALATE})
            break
        decision = decide_incident.fn(triaged.incident)
    if not seen:
        decision = decide_incident.fn(incident_id)
    elif decision.action is Action.DIAGNOSE:
        decision = decision.model_copy(update={"action": Action.ESCALATE})
    # _tag_run: a Prefect API call only; nothing to do without a flow run.
    try:
        acted = act.fn(incident_id, node, triaged.gpu, decision)
    except Exception as error:
        acted = ActOutcome(action=decision.action, status="escalated", detail=f"action failed: {error}")
    resumed = None
    if acted.took_node_out:
        for job in triaged.jobs:
            resumed = resume_job.fn(incident_id, job, [node])
    verified = None
    if acted.status == "done" and decision.action in DESTRUCTIVE:
        verified = verify.fn(
            incident_id, node, current().policy().policy.defaults.verify_level, decision.action
        )
    summary = summary_of(decision, acted, resumed, verified, None)
    updates = [f"DCGM {s}" for s in seen] + [
        f"Decision: {decision.action.value} — {acted.status}: {acted.detail}"
    ]
    if resumed:
        updates.append(resumed.describe())
    if verified:
        updates.append(verified.detail)
    for text in [*updates, f"Closed: {summary}"]:
        notifier.reply(thread, text)
    close.fn(incident_id, summary, status=closing_status(acted, verified))
    detail = current().store.incident_detail(incident_id)
    if detail is not None:
        incident_markdown(detail)  # the flow turns this into an artifact; rendering it is ours
    return outcome_of(incident_id, node, decision, acted, resumed, verified, seen, True, summary)


def _in_tasks(rt: Any, incident_id: str) -> float:
    """Seconds spent inside the task bodies (the store's stage rows) for one incident."""
    detail = rt.store.incident_detail(incident_id)
    return sum((s.finished_at - s.started_at).total_seconds() for s in detail.steps)


def _check(rt: Any, outcome: Any, incident_id: str) -> None:
    row = rt.store.get_incident(incident_id)
    ok = outcome.action == "reboot" and outcome.act == "done" and outcome.resumed and outcome.verified
    if not ok or row.status != "closed" or not outcome.verified.passed:
        raise RuntimeError(f"{incident_id} did not take the full path: {outcome.summary} ({row.status})")


def measure(out: Path, count: int = INCIDENTS) -> None:
    """Both paths, in this process; results as JSON in `out`."""
    started = time.perf_counter()
    importlib.import_module("medic.flows.remediate")  # imports Prefect: part of the cold start
    import_s = time.perf_counter() - started
    from medic.apps.cli.prefect_run import run_flows
    from medic.flows.remediate import remediate

    work = Path(os.environ["MEDIC_BENCH_DIR"])
    results: dict[str, Any] = {"incidents": count, "import_s": import_s}

    # (b) direct, first: nothing of Prefect's is running yet. Incident 0 warms up and is not counted.
    rt, incidents = _setup(count + 1, "direct", work)
    direct, direct_tasks = [], []
    for n, incident in enumerate(incidents):
        start = time.perf_counter()
        outcome = remediate_direct(incident.id, incident.node)
        seconds = time.perf_counter() - start
        _check(rt, outcome, incident.id)
        if n:
            direct.append(seconds)
            direct_tasks.append(_in_tasks(rt, incident.id))
        else:
            results["direct_warmup_s"] = seconds
    results["direct"], results["direct_tasks"] = direct, direct_tasks

    # (a) the flow. The first run starts the temporary Prefect server: reported as the cold start.
    rt, incidents = _setup(count + 1, "flow", work)

    async def all_flows() -> tuple[list[float], list[float], float]:
        samples, in_tasks, cold = [], [], 0.0
        for n, incident in enumerate(incidents):
            start = time.perf_counter()
            outcome = await remediate(incident_id=incident.id, node=incident.node)
            seconds = time.perf_counter() - start
            _check(rt, outcome, incident.id)
            if n:
                samples.append(seconds)
                in_tasks.append(_in_tasks(rt, incident.id))
            else:
                cold = seconds
        return samples, in_tasks, cold

    start = time.perf_counter()
    results["flow"], results["flow_tasks"], results["cold_s"] = run_flows(all_flows())
    results["flow_total_s"] = time.perf_counter() - start  # incl. server stop and the event/log drain
    out.write_text(json.dumps(results))


def run(count: int = INCIDENTS) -> dict[str, Any]:
    """Start the measuring process with a fresh PREFECT_HOME (ephemeral server) and collect its JSON."""
    with tempfile.TemporaryDirectory(prefix="medic-bench-flow-") as tmp:
        work = Path(tmp)
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_PROFILE")}
        env.update(
            PREFECT_HOME=str(work / "prefect-home"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            MEDIC_HOME=str(work / "medic-home"),
            MEDIC_BENCH_DIR=str(work),
            PYTHONPATH=IMPORT_ROOT,
        )
        out, log = work / "result.json", work / "prefect.log"
        start = time.perf_counter()
        with log.open("w") as handle:
            done = subprocess.run(
                [sys.executable, "-m", "bench.flow_overhead", str(out), str(count)],
                cwd=REPO_ROOT,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        process_s = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"flow benchmark failed ({done.returncode}):\n{log.read_text()[-4000:]}")
        results = json.loads(out.read_text())
    results["process_s"] = process_s
    for key in ("direct", "flow", "direct_tasks", "flow_tasks"):
        results[key] = Stats.of(results[key])
    return results


def section(r: dict[str, Any]) -> str:
    flow, direct = r["flow"], r["direct"]
    flow_tasks, direct_tasks = r["flow_tasks"], r["direct_tasks"]
    ratio = flow.median / direct.median
    around = (flow.median - flow_tasks.median) - (direct.median - direct_tasks.median)
    per_run = around / (TASK_RUNS + 1)
    inside = flow_tasks.median - direct_tasks.median
    slower = (
        f"The task bodies themselves took {ms(inside)} longer under the flow: the server process and"
        " Prefect's event and log threads compete with them for the same cores."
        if inside > 0
        else "The task bodies themselves took no longer under the flow."
    )
    rows = [
        [
            "(a) `remediate` flow (ephemeral Prefect)",
            f"**{ms(flow.median)}**",
            f"{ms(flow.low)} - {ms(flow.high)}",
            ms(flow.p95),
            ms(flow_tasks.median),
            ms(flow.median - flow_tasks.median),
        ],
        [
            "(b) same task functions called directly (`.fn`)",
            f"**{ms(direct.median)}**",
            f"{ms(direct.low)} - {ms(direct.high)}",
            ms(direct.p95),
            ms(direct_tasks.median),
            ms(direct.median - direct_tasks.median),
        ],
        [
            "**overhead (a) - (b)**",
            f"**{ms(flow.median - direct.median)}**",
            "-",
            "-",
            ms(flow_tasks.median - direct_tasks.median),
            ms(around),
        ],
    ]
    return "\n".join(
        [
            "## 3. Per-incident overhead of the Prefect flow",
            "",
            f"{r['incidents']} incidents per path, each an XID 79 on a distinct node of a simulated fleet",
            "running a 2-node job, so the full path runs: triage → decide → act (drain + reboot) → resume",
            "job → verify (DCGM L1, resume node) → notify → close. (a) runs `medic.flows.remediate.remediate` per",
            "incident; (b) runs `bench.flow_overhead.remediate_direct`, the same stage order calling each",
            "task's undecorated `.fn` (no task runs, states, tags, artifact or API calls). Each path has its",
            "own fresh fleet, temporary SQLite store and one uncounted warm-up incident, in one process",
            'with a fresh temporary `PREFECT_HOME`. "Inside tasks" sums the stage rows the tasks write',
            'to the store (the task bodies\' own time); "around tasks" is the rest.',
            "",
            table(["per incident", "median", "min - max", "p95", "inside tasks", "around tasks"], rows),
            "",
            f"The flow costs **{ms(flow.median - direct.median)} more per incident** ({ratio:.1f}x the direct",
            "path). Both paths include the simulated job's 50 ms first poll in `resume_job`. Spread over",
            f"the flow run and its {TASK_RUNS} task runs, the time around the tasks is about {ms(per_run)}",
            "per run (creating runs, state changes, the tag update and the artifact, through the API of",
            f"the temporary server). {slower}",
            "",
            table(
                ["one-off costs", "seconds"],
                [
                    [
                        "first flow run, incl. starting the temporary Prefect server (not counted above)",
                        num(r["cold_s"]),
                    ],
                    ["importing `medic.flows.remediate` (Prefect included)", num(r["import_s"])],
                    ["whole flow phase incl. server stop and event/log drain", num(r["flow_total_s"])],
                    ["whole benchmark process", num(r["process_s"])],
                ],
            ),
        ]
    )


if __name__ == "__main__":
    measure(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else INCIDENTS)
