"""At fleet scale: a burst of faults on a large simulated fleet behind `medic serve` replicas.

Scenario (a) of issue 40: fatal XIDs (79, fallen off the bus) on FATAL nodes and non-fatal ones
(13 and 43, the application's or nothing to do) on NONFATAL others, every event posted within
BURST_S seconds, each node's event in its own small batch as a fleet's exporters send them,
alternating between the replicas as a load balancer would. The replicas are `medic serve`'s warm
path (this package's `bench.live serve`: the ingest app under uvicorn with the in-process
dispatcher), each over a simulated fleet of NODES nodes, 16 a leaf switch; one PostgreSQL store;
one Prefect server on PostgreSQL. The default policy, guardrails on.

What is real: the HTTP ingest, the replicas, the store and its locks, Prefect's server, the
policy, the guardrail slot. What is simulated: the scheduler and the provider (each replica holds
its own simulated fleet: a drain one replica makes is not seen by the other's scheduler; the
decisions add every replica's drains from the store (decision 0023), and the store's record of
drains is what is measured), DCGM and the chat. Everything, the load generator included, shares
one machine.

Measured from outside the product: every acknowledged event in the store (plain counts), the set
of nodes drained (the store's drain actions) against the set the policy allows (every fatal node:
200 drains are within `max_out_of_service_percent`), the time from the first POST to that exact
set, each fatal node's POST → drain intent (contain p50 / p99), the incidents and how many are
still being handled then (the backlog), and each replica's resident memory.

`python -m bench.fleet_burst [NODES FATAL NONFATAL REPLICAS]` prints the section's table.
"""

from __future__ import annotations

import concurrent.futures
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import REPO_ROOT
from bench.ingest import percentile
from bench.live import POSTGRES_ADMIN_URL, _epoch, _event, _Server
from bench.prefect_server import fresh_database, prefect_on_postgres
from bench.report import ms, num, table

NODES = 10_000
FATAL = 200
NONFATAL = 1_800
REPLICAS = 2
PER_SWITCH = 16
BURST_S = 10.0
SENDERS = 8  # concurrent connections posting, as many exporters do
SETTLE_S = 300.0


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def burst_events(
    nodes: int, fatal: int, nonfatal: int, seed: int = 40
) -> tuple[list[dict[str, Any]], set[str]]:
    """One event per struck node, shuffled; and the fatal nodes."""
    draw = random.Random(seed)
    struck = draw.sample(range(1, nodes + 1), fatal + nonfatal)
    fatal_nodes = {f"gpu-node-{n}" for n in struck[:fatal]}
    events = []
    for i, n in enumerate(struck):
        node = f"gpu-node-{n}"
        code = 79 if node in fatal_nodes else draw.choice((13, 43))
        events.append(_event(f"burst-{i}", "xid", node, gpu=draw.randrange(8), attributes={"code": code}))
    draw.shuffle(events)
    return events, fatal_nodes


def run(nodes: int, fatal: int, nonfatal: int, replicas: int) -> dict[str, Any]:
    from medic.store import Store
    from medic.store.metrics import CONTAIN_STAGE
    from medic.store.tables import EventRecord

    policy = REPO_ROOT / "policies" / "default.yaml"
    events, fatal_nodes = burst_events(nodes, fatal, nonfatal)
    with ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="medic-fleet-")))
        database = stack.enter_context(fresh_database(POSTGRES_ADMIN_URL))
        api = stack.enter_context(prefect_on_postgres(directory / "prefect-server"))
        env = {"MEDIC_DATABASE_URL": database}
        servers = []
        for r in range(replicas):
            home = directory / f"replica-{r}"
            home.mkdir()
            servers.append(stack.enter_context(_Server(home, nodes, PER_SWITCH, policy, api, extra_env=env)))
        store = Store(database)
        rss_idle = [_rss_mb(s.process.pid) for s in servers]
        posted: dict[str, float] = {}

        def send(index: int) -> None:
            event = events[index]
            posted[event["node"]] = time.time()
            event["time"] = datetime.fromtimestamp(posted[event["node"]], UTC).isoformat()  # as sent
            servers[index % replicas].post([event])

        started = time.time()
        pace = BURST_S / len(events)
        with concurrent.futures.ThreadPoolExecutor(SENDERS) as pool:
            futures = []
            for i in range(len(events)):
                time.sleep(max(0.0, started + i * pace - time.time()))
                futures.append(pool.submit(send, i))
            for future in futures:
                future.result()  # every event acknowledged (a refusal raises)
        posting_s = time.time() - started

        since = datetime.fromtimestamp(started - 1, UTC)
        deadline = time.monotonic() + SETTLE_S
        exact_at = None
        while time.monotonic() < deadline:
            drained = {a.node: _epoch(a.intent_at) for a in store.actions_since(since, ["drain"])}
            if set(drained) >= fatal_nodes:
                exact_at = max(drained[n] for n in fatal_nodes)
                break
            time.sleep(0.2)
        drained = {a.node: _epoch(a.intent_at) for a in store.actions_since(since, ["drain"])}
        incidents = store.find_incidents(since=since, limit=len(events) + 100)
        backlog = sum(1 for i in incidents if i.closed_at is None)
        stored = store.count(EventRecord)
        rss_burst = [_rss_mb(s.process.pid) for s in servers]
        contain = [drained[n] - posted[n] for n in fatal_nodes if n in drained]
        # Where a fatal node's time went: waiting to be opened, waiting to be contained, containing.
        opened, queued, containing = [], [], []
        for incident in incidents:
            if incident.node not in fatal_nodes:
                continue
            opened.append(_epoch(incident.opened_at) - posted[incident.node])
            step = next((s for s in store.steps_of(incident.id) if s.stage == CONTAIN_STAGE), None)
            if step is not None:
                queued.append(_epoch(step.started_at) - _epoch(incident.opened_at))
                containing.append(_epoch(step.finished_at) - _epoch(step.started_at))
        store.close()
        return {
            "nodes": nodes,
            "fatal": fatal,
            "nonfatal": nonfatal,
            "replicas": replicas,
            "posting_s": posting_s,
            "acknowledged": len(events),
            "stored": stored,
            "drained": len(drained),
            "wrongly_drained": sorted(set(drained) - fatal_nodes)[:10],
            "missed": sorted(fatal_nodes - set(drained))[:10],
            "to_exact_s": None if exact_at is None else exact_at - started,
            "contain_p50": percentile(contain, 0.5) if contain else None,
            "contain_p99": percentile(contain, 0.99) if contain else None,
            "opened_p50": percentile(opened, 0.5) if opened else None,
            "queued_p50": percentile(queued, 0.5) if queued else None,
            "containing_p50": percentile(containing, 0.5) if containing else None,
            "containing_p99": percentile(containing, 0.99) if containing else None,
            "incidents": len(incidents),
            "backlog_at_exact": backlog,
            "rss_idle_mb": rss_idle,
            "rss_burst_mb": rss_burst,
        }


def render(result: dict[str, Any]) -> str:
    exact = result["to_exact_s"]
    rows = [
        ("fleet / replicas", f"{num(result['nodes'])} simulated nodes / {result['replicas']}"),
        (
            "burst",
            f"{result['fatal']} fatal + {num(result['nonfatal'])} non-fatal in {result['posting_s']:.1f} s",
        ),
        ("events acknowledged / stored", f"{result['acknowledged']} / {result['stored']}"),
        (
            "nodes drained (exact set: the fatal ones)",
            f"{result['drained']}; wrong {result['wrongly_drained']}, missed {result['missed']}",
        ),
        ("first POST → exact set", "not reached" if exact is None else f"{exact:.1f} s"),
        ("contain p50 / p99", f"{ms(result['contain_p50'] or 0)} / {ms(result['contain_p99'] or 0)}"),
        (
            "incidents / still being handled at the exact set",
            f"{result['incidents']} / {result['backlog_at_exact']}",
        ),
        (
            "replica memory idle → after (MB)",
            ", ".join(
                f"{a:.0f} → {b:.0f}"
                for a, b in zip(result["rss_idle_mb"], result["rss_burst_mb"], strict=True)
            ),
        ),
    ]
    return table(("measure", "value"), rows)


def main(argv: list[str]) -> None:
    numbers = [int(a) for a in argv] or [NODES, FATAL, NONFATAL, REPLICAS]
    result = run(*numbers)
    print(render(result))
    print(result)


if __name__ == "__main__":
    main(sys.argv[1:])
