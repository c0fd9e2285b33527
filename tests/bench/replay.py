"""`medic policy replay` over 10,000 and 100,000 recorded incidents: reading the store, deciding again,
replaying the guardrails.

A temporary SQLite store is filled as the flows fill it, in bulk: incidents of 1-3 events each (every
kind, realistic attributes) over 90 days on 10,000 nodes, each with the two decisions the flows record
(triage's first answer, then the final one a minute later), made by the default policy's engine on
`facts_of` facts and kept with `record_facts`. The replay is then timed in one process, stage by stage
(`Store.replay_history`, `medic.whatif.replay.redecide`, `medic.whatif.replay_report.judge`), with the
default policy itself (nothing changes) and with an edit that changes the action of the most frequent
rule; and end to end as `medic policy replay FILE --store URL --json > /dev/null`, which splits the
reading and deciding over two processes (medic/apps/cli/replay_parallel.py).
"""

from __future__ import annotations

import gc
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import insert

from bench import REPO_ROOT
from bench.flow_overhead import policy_without_guardrails
from bench.report import Stats, num, table
from bench.triage import JOB_KINDS, KIND_WEIGHTS, SOURCES, random_attributes
from medic.apps.cli.replay_parallel import PARALLEL_FROM
from medic.context import Context
from medic.events import EventKind, FaultEvent
from medic.facts import facts_of
from medic.incidents import Incident, incident_id
from medic.policy import LoadedPolicy, decide, load_policy
from medic.store import Store
from medic.store.tables import DecisionRecord, EventRecord, IncidentRecord
from medic.whatif.replay import record_facts, redecide
from medic.whatif.replay_report import judge

SIZES = (10_000, 100_000)  # incidents
NODES = 10_000
DAYS = 90
REPEATS = 3
TARGET_S = 10.0
START = datetime(2026, 10, 1, tzinfo=UTC)
EDITED_RULE = "xid-fallen-off-bus"  # its action becomes `replace` in the edited policy: every XID 79 changes
# Kinds that are a node's history or a diagnostic's result, not the trouble that opens an incident.
NOT_OPENING = {"remediation", "diagnostic"}


def _policies(directory: Path) -> tuple[Path, Path]:
    """The default policy without its guardrails, and the same with one rule's action edited.

    Without guardrails: the fill decides without a fleet, so the recorded decisions are the rules'
    alone, and the replay's guardrails (checked for every decision all the same) stop nothing."""
    base = policy_without_guardrails(directory)
    data = yaml.safe_load(base.read_text(encoding="utf-8"))
    for rule in data["rules"]:
        if rule["id"] == EDITED_RULE:
            rule["then"]["action"] = "replace"
    edited = directory / "edited.yaml"
    edited.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return base, edited


def _incidents(count: int, seed: int = 7) -> list[Incident]:
    rng = random.Random(seed)
    kinds = [k for k in KIND_WEIGHTS if k not in NOT_OPENING]
    weights = [KIND_WEIGHTS[k] for k in kinds]
    spacing = timedelta(days=DAYS) / count
    incidents = []
    for i in range(count):
        n = rng.randrange(1, NODES + 1)
        node, at = f"gpu-node-{n:04d}", START + spacing * i
        events = []
        for j in range(rng.choice([1, 1, 2, 3])):
            kind = rng.choices(kinds, weights)[0]
            fields: dict[str, Any] = {"gpu": rng.randrange(8), "switch": f"leaf-{(n - 1) // 16 + 1}"}
            if kind in JOB_KINDS:
                fields |= {"job": f"job-{(n - 1) // 64}", "rank": rng.randrange(512), "iteration": i}
            events.append(
                FaultEvent(
                    id=f"ev-{i:06d}-{j}",
                    time=at + timedelta(seconds=10 * j),
                    source="job" if kind in JOB_KINDS else SOURCES.get(kind, "agent"),
                    kind=EventKind(kind),
                    node=node,
                    attributes=random_attributes(kind, rng),
                    **fields,
                )
            )
        incidents.append(Incident(incident_id(node, events[0].id), node, events))
    return incidents


def fill(store: Store, loaded: LoadedPolicy, count: int) -> int:
    """Write `count` incidents, their events and two decisions each; returns the decisions written."""
    incidents = _incidents(count)
    context = Context([e for i in incidents for e in i.events], fleet_size=NODES)
    events: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    for incident in incidents:
        rows.append(
            {
                "id": incident.id,
                "node": incident.node,
                "scope": "node",
                "switch": incident.switch,
                "opened_at": incident.opened_at,
                "last_event_at": incident.last_at,
                "status": "closed",
                "jobs": incident.jobs,
            }
        )
        for event in incident.events:
            events.append(
                event.model_dump(exclude={"kind"})
                | {"kind": event.kind.value, "received_at": event.time, "incident_id": incident.id}
            )
        for stage_s in (5, 60):  # triage, then decide
            now = incident.last_at + timedelta(seconds=stage_s)
            facts = facts_of(incident, now=now, context=context)
            decision = decide(loaded.policy, facts, loaded.sha256)
            decisions.append(
                {
                    "incident_id": incident.id,
                    "decided_at": now,
                    "policy_path": loaded.path,
                    "policy_sha256": loaded.sha256,
                    "rule": decision.rule,
                    "classification": decision.classification.value,
                    "action": decision.action.value,
                    "diagnose_level": decision.diagnose_level,
                    "reason": decision.reason,
                    "matched": decision.matched,
                    "recommend": decision.recommend,
                    "facts": record_facts(facts),
                }
            )
    with store.engine.begin() as connection:
        for table_, values in ((EventRecord, events), (IncidentRecord, rows), (DecisionRecord, decisions)):
            for start in range(0, len(values), 10_000):
                connection.execute(insert(table_), values[start : start + 10_000])
    return len(decisions)


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds of this process, the result)."""
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, value


def time_in_process(store: Store, loaded: LoadedPolicy, repeats: int) -> dict[str, Any]:
    """The replay's stages in one process, the collector paused as the CLI pauses it."""
    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        gc.disable()
        try:
            read_s, read_cpu, history = _timed(
                partial(store.replay_history, since=None, lookback=loaded.policy.lookback())
            )
            decide_s, decide_cpu, decided = _timed(partial(redecide, history, loaded))
            judge_s, judge_cpu, report = _timed(
                partial(judge, [decided], loaded, history.breaker_closed_at, None)
            )
        finally:
            gc.enable()
        del history, decided
        for name, wall, cpu in (
            ("read", read_s, read_cpu),
            ("decide", decide_s, decide_cpu),
            ("guardrails", judge_s, judge_cpu),
            ("total", read_s + decide_s + judge_s, read_cpu + decide_cpu + judge_cpu),
        ):
            samples.setdefault(name, []).append(wall)
            samples.setdefault(f"{name} cpu", []).append(cpu)
    return {
        **{name: Stats.of(values) for name, values in samples.items()},
        "changed": report.changed,
        "incidents": report.incidents,
        "decisions": report.decisions,
    }


def time_cli(url: str, policy: Path, repeats: int) -> dict[str, Stats]:
    """Wall and CPU seconds (user + system) of the command, one sample per run."""
    medic = Path(sys.executable).parent / "medic"
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(
            [str(medic), "policy", "replay", str(policy), "--store", url, "--json"],
            cwd=REPO_ROOT,
            env=os.environ.copy(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        wall.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        if done.returncode != 0:
            raise RuntimeError(f"medic policy replay failed ({done.returncode}): {done.stderr[-2000:]}")
    return {"wall": Stats.of(wall), "cpu": Stats.of(cpu)}


def run() -> dict[str, Any]:
    return {"sizes": [_run(incidents) for incidents in SIZES]}


def _run(incidents: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="medic-bench-replay-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'medic.db'}"
        store = Store(url)
        base, edited = _policies(Path(tmp))
        default = load_policy(base)
        fill_s, _, decisions = _timed(partial(fill, store, default, incidents))
        same = time_in_process(store, default, REPEATS)
        changed = time_in_process(store, load_policy(edited), REPEATS)
        cli = time_cli(url, edited, REPEATS)
        store.close()
    return {
        "incidents": incidents,
        "decisions": decisions,
        "fill_s": fill_s,
        "same": same,
        "edited": changed,
        "cli": cli,
    }


STAGES = (
    ("read the store (`replay_history`)", "read"),
    ("decide again (`redecide`)", "decide"),
    ("guardrails and comparison (`judge`)", "guardrails"),
    ("total", "total"),
)


def section(r: dict[str, Any]) -> str:
    sizes = r["sizes"]
    rows = []
    for size in sizes:
        for label, key in (
            ("the default policy itself", "same"),
            ("the XID 79 rule's action edited", "edited"),
        ):
            m = size[key]
            for stage, name in STAGES:
                wall: Stats = m[name]
                cpu: Stats = m[f"{name} cpu"]
                rows.append(
                    [
                        f"{size['incidents']:,}" if (key, name) == ("same", "read") else "",
                        label if name == "read" else "",
                        stage,
                        f"{num(wall.median)} s",
                        f"{num(wall.low)} - {num(wall.high)} s",
                        f"{num(cpu.median)} s",
                        f"{m['changed']:,}" if name == "total" else "",
                    ]
                )
    largest = sizes[-1]
    wall = largest["cli"]["wall"]
    verdict = "meets" if wall.median < TARGET_S else "**does not meet**"
    ends = [
        f"{s['incidents']:,} incidents **{num(s['cli']['wall'].median)} s** ({num(s['cli']['wall'].low)} - "
        f"{num(s['cli']['wall'].high)} s, {num(s['cli']['cpu'].median)} s of CPU)"
        for s in sizes
    ]
    fills = ", ".join(f"{s['incidents']:,} in {num(s['fill_s'])} s" for s in sizes)
    counts = " and ".join(f"{s['incidents']:,}" for s in sizes)
    return "\n".join(
        [
            "## Replaying recorded incidents: `medic policy replay`",
            "",
            f"SQLite stores of {counts} incidents (two decisions per",
            f"incident as the flows record them, each with its facts) over {DAYS} days on {NODES:,} nodes, filled",
            f"({fills}), replayed in one process, stage by stage (median of {REPEATS} repeats; CPU: seconds",
            "of this process, which a busy machine inflates less than wall time):",
            "",
            table(
                [
                    "incidents",
                    "policy",
                    "stage",
                    "wall (median)",
                    "wall min - max",
                    "CPU (median)",
                    "incidents changed",
                ],
                rows,
            ),
            "",
            "End to end, `medic policy replay EDITED.yaml --store URL --json > /dev/null`, which reads and decides",
            f"the two halves of the incidents in two processes from {PARALLEL_FROM:,} incidents on",
            f"(medic/apps/cli/replay_parallel.py; {REPEATS} runs each, interpreter start and imports included, CPU",
            f"of both processes): {'; '.join(ends)}. That is {num(largest['incidents'] / wall.median)}",
            f"incidents/s: it {verdict} the target of {largest['incidents']:,} incidents in under {TARGET_S:g} s.",
        ]
    )
