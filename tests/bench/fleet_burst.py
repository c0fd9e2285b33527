"""At fleet scale: bursts of faults on a large simulated fleet behind `medic serve` replicas.

The bursts of issue 40, each node's event in its own small batch as a fleet's exporters send
them, alternating between the replicas as a load balancer would:

- (a) fatal XIDs (79, fallen off the bus) on FATAL nodes and non-fatal ones (13 and 43, the
  application's or nothing to do) on NONFATAL others, within BURST_S seconds;
- (b) fatal XIDs on FATAL nodes, more than the guardrails let out: the nodes drained must be
  exactly as many as the first limit to bind allows (`max_out_of_service_percent`, or the circuit
  breaker where a site sets it lower), all of them fatal ones, and once the breaker opens it holds:
  no drain after it;
- (c) a switch-tier storm: a collective timeout from every node under SWITCHES leaf switches: one
  switch-wide incident per switch and not one node action.

The replicas are `medic serve`'s warm path (this package's `bench.live serve`: the ingest app under
uvicorn with the in-process dispatcher), each over a simulated fleet of NODES nodes, 16 a leaf
switch; one PostgreSQL store; one Prefect server on PostgreSQL. The default policy, guardrails on.

What is real: the HTTP ingest, the replicas, the store and its locks, Prefect's server, the
policy, the guardrail slot. What is simulated: the scheduler and the provider (each replica holds
its own simulated fleet, and sees the nodes the others drained as drained, from the store's record
of their drains, as replicas asking one real scheduler do: `bench.live.SharedDrains`; the store's
record of drains is what is measured), DCGM and the chat. Everything, the load generator included, shares
one machine.

Measured from outside the product: every acknowledged event in the store (plain counts), the set
of nodes drained (the store's drain actions) against the set the policy and guardrails allow, the
time from the first POST to that exact set, each drained node's POST → drain intent (contain p50 /
p99), the incidents and how many are still being handled then (the backlog), and each replica's
resident memory.

`PYTHONPATH=tests python -m bench.fleet_burst [a NODES FATAL NONFATAL | b NODES FATAL [BREAKER_PERCENT] | c NODES
SWITCHES] [--replicas N] [--dispatch local|prefect]` prints the burst's table (`--dispatch prefect`:
the scaled-out path, `medic serve --dispatch prefect` and a process worker; burst (a) only).
"""

from __future__ import annotations

import concurrent.futures
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import REPO_ROOT
from bench.ingest import percentile
from bench.live import (
    POSTGRES_ADMIN_URL,
    SERVE_PREFECT,
    SHARED_DRAINS_ENV,
    Server,
    epoch,
    event_dict,
    process_worker,
    server_env,
)
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
STORM_SWITCHES = 32
DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"


def rss_mb(pid: int) -> float:
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
        events.append(event_dict(f"burst-{i}", "xid", node, gpu=draw.randrange(8), attributes={"code": code}))
    draw.shuffle(events)
    return events, fatal_nodes


def storm_events(switches: int, seed: int = 40) -> list[dict[str, Any]]:
    """A collective timeout from every node under the first `switches` leaf switches, shuffled (the
    simulated fleet puts nodes 1-16 under leaf-1, and so on)."""
    events = []
    for s in range(switches):
        for offset in range(PER_SWITCH):
            n = s * PER_SWITCH + offset + 1
            events.append(
                event_dict(
                    f"storm-{n}",
                    "nccl_timeout",
                    f"gpu-node-{n}",
                    switch=f"leaf-{s + 1}",
                    job=f"job-{s}",
                    rank=offset,
                )
            )
    random.Random(seed).shuffle(events)
    return events


@dataclass
class Fleet:
    """Replicas of `medic serve` over simulated fleets of one shape, one store, one Prefect server."""

    servers: list[Server]
    store: Any  # medic.store.Store
    rss_idle: list[float]
    posted: dict[str, float] = field(default_factory=dict)  # node → when its event was sent
    started: float = 0.0
    posting_s: float = 0.0
    resent: int = 0

    def post(self, events: list[dict[str, Any]]) -> None:
        """Every event in its own POST, spread over BURST_S (or as fast as the replicas answer);
        returns once every one is acknowledged (a refusal raises)."""
        replicas = len(self.servers)

        def send(index: int) -> None:
            event = events[index]
            self.posted[event["node"]] = time.time()
            event["time"] = datetime.fromtimestamp(self.posted[event["node"]], UTC).isoformat()  # as sent
            for attempt in range(3):
                try:
                    self.servers[index % replicas].post([event])
                    return
                except httpx.TransportError:
                    # A keep-alive connection the replica closed as it was reused (uvicorn closes
                    # one idle for 5 s): sent again, as the agents' sinks do; the id makes it once.
                    self.resent += 1
                    if attempt == 2:
                        raise

        self.started = time.time()
        pace = BURST_S / len(events)
        with concurrent.futures.ThreadPoolExecutor(SENDERS) as pool:
            futures = []
            for i in range(len(events)):
                time.sleep(max(0.0, self.started + i * pace - time.time()))
                futures.append(pool.submit(send, i))
            for future in futures:
                future.result()
        self.posting_s = time.time() - self.started

    def since(self) -> datetime:
        return datetime.fromtimestamp(self.started - 1, UTC)

    def drained(self) -> dict[str, float]:
        """Each node drained since the burst began, and its drain's intent."""
        return {a.node: epoch(a.intent_at) for a in self.store.actions_since(self.since(), ["drain"])}

    def until(self, done: Any) -> float | None:
        """Poll until `done()` is true; when it became true (epoch seconds), or None after SETTLE_S."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            if done():
                return time.time()
            time.sleep(0.2)
        return None

    def common(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        from medic.store.tables import EventRecord

        incidents = self.store.find_incidents(since=self.since(), limit=len(events) + 100)
        return {
            "replicas": len(self.servers),
            "posting_s": self.posting_s,
            "resent": self.resent,
            "acknowledged": len(events),
            "stored": self.store.count(EventRecord),
            "incidents": len(incidents),
            "backlog": sum(1 for i in incidents if i.closed_at is None),
            "rss_idle_mb": self.rss_idle,
            "rss_burst_mb": [rss_mb(s.process.pid) for s in self.servers],
        }


@contextmanager
def fleet(
    nodes: int, replicas: int, policy: Path = DEFAULT_POLICY, dispatch: str = "local"
) -> Iterator[Fleet]:
    """`dispatch` "local": the replicas run flow runs in process (`bench.live serve`). "prefect": they
    are `medic serve --dispatch prefect` (the service contains, the deployment's trigger starts each
    flow run) and a process worker runs each in a fresh process; the service and each flow run hold
    simulated fleets of their own, so drains are shared only through the store."""
    from medic.store import Store

    with ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="medic-fleet-")))
        database = stack.enter_context(fresh_database(POSTGRES_ADMIN_URL))
        api = stack.enter_context(prefect_on_postgres(directory / "prefect-server"))
        env = {"MEDIC_DATABASE_URL": database, SHARED_DRAINS_ENV: "1"}
        command = None
        if dispatch == "prefect":
            command = SERVE_PREFECT
            env |= {
                "MEDIC_BACKENDS": "sim",
                "MEDIC_SIM_NODES": str(nodes),
                "MEDIC_POLICY": str(policy),
                "PREFECT_WORKER_QUERY_SECONDS": "1",
            }
            stack.enter_context(process_worker(directory, server_env(directory, api) | env))
        servers = []
        for r in range(replicas):
            home = directory / f"replica-{r}"
            home.mkdir()
            servers.append(
                stack.enter_context(
                    Server(home, nodes, PER_SWITCH, policy, api, command=command, extra_env=env)
                )
            )
        store = Store(database)
        stack.callback(store.close)
        yield Fleet(servers, store, [rss_mb(s.process.pid) for s in servers])


def _contain(drained: dict[str, float], posted: dict[str, float]) -> dict[str, float | None]:
    contain = [at - posted[node] for node, at in drained.items()]
    return {
        "contain_p50": percentile(contain, 0.5) if contain else None,
        "contain_p99": percentile(contain, 0.99) if contain else None,
    }


def run(
    nodes: int, fatal: int, nonfatal: int, replicas: int = REPLICAS, dispatch: str = "local"
) -> dict[str, Any]:
    """Burst (a): every fatal node drained, no other."""
    from medic.store.metrics import CONTAIN_STAGE

    events, fatal_nodes = burst_events(nodes, fatal, nonfatal)
    with fleet(nodes, replicas, dispatch=dispatch) as f:
        f.post(events)
        exact_at = f.until(lambda: set(f.drained()) >= fatal_nodes)
        drained = f.drained()
        result = f.common(events)
        # Where a fatal node's time went: waiting to be opened, waiting to be contained, containing.
        opened, queued, containing = [], [], []
        for incident in f.store.find_incidents(since=f.since(), limit=len(events) + 100):
            if incident.node not in fatal_nodes:
                continue
            opened.append(epoch(incident.opened_at) - f.posted[incident.node])
            step = next((s for s in f.store.steps_of(incident.id) if s.stage == CONTAIN_STAGE), None)
            if step is not None:
                queued.append(epoch(step.started_at) - epoch(incident.opened_at))
                containing.append(epoch(step.finished_at) - epoch(step.started_at))
        return (
            result
            | _contain(drained, f.posted)
            | {
                "burst": "a",
                "nodes": nodes,
                "fatal": fatal,
                "nonfatal": nonfatal,
                "drained": len(drained),
                "wrongly_drained": sorted(set(drained) - fatal_nodes)[:10],
                "missed": sorted(fatal_nodes - set(drained))[:10],
                "to_exact_s": None if exact_at is None else max(drained[n] for n in fatal_nodes) - f.started,
                "opened_p50": percentile(opened, 0.5) if opened else None,
                "queued_p50": percentile(queued, 0.5) if queued else None,
                "containing_p50": percentile(containing, 0.5) if containing else None,
                "containing_p99": percentile(containing, 0.99) if containing else None,
            }
        )


def _levels_policy(breaker_percent: float, directory: Path) -> Path:
    """The default policy with the circuit breaker's level at `breaker_percent` of the fleet and no
    limit on destructive actions per hour: (b) measures the two limits on a level of nodes out.
    With the default 20 an hour, a burst's reboots (and, once 20 are recorded, its containments)
    stop at that limit first, at a moment that depends on how fast flow runs reach their reboots."""
    text = DEFAULT_POLICY.read_text()
    edits = {
        "    nodes_percent: 25\n": f"    nodes_percent: {breaker_percent:g}\n",
        "  max_destructive_per_hour: 20\n": "  max_destructive_per_hour: null\n",
    }
    for before, after in edits.items():
        if before not in text:
            raise RuntimeError(
                f"the default policy's {before.strip()} moved: update tests/bench/fleet_burst.py"
            )
        text = text.replace(before, after)
    path = directory / "levels.yaml"
    path.write_text(text)
    return path


def allowed_out(nodes: int, breaker_percent: float) -> tuple[int, bool]:
    """How many nodes the default guardrails let out of a healthy fleet of `nodes` at once, and
    whether the breaker is the limit that binds (it is checked first, so it wins a tie)."""
    out = max(1, math.ceil(nodes * 10 / 100))  # max_out_of_service_percent: 10
    breaker = max(1, math.ceil(nodes * breaker_percent / 100))
    return min(out, breaker), breaker <= out


def out_over_time(store: Any, since: datetime) -> list[tuple[float, int]]:
    """(when, how many nodes taken out) after each of our drains since `since`. It looks for
    returns under the name `reintegrate`, which the store does not use (a node's return is
    `resume`): so every drain counts to the end, and the figure is the nodes taken out in the burst,
    not the most out at once. Counting returns is the next change: the simulated nodes come back
    within seconds, and the tests' exact figures must then say which they pin."""
    from sqlmodel import col, select

    from medic.store.tables import ActionRecord

    query = (
        select(ActionRecord.node, ActionRecord.action, ActionRecord.intent_at, ActionRecord.finished_at)
        .where(col(ActionRecord.action).in_(["drain", "reintegrate"]))
        .where(col(ActionRecord.intent_at) >= since)
    )
    changes = []
    with store.session() as s:
        for node, action, intent_at, finished_at in s.exec(query):
            if action == "drain":
                changes.append((epoch(intent_at), 1, node))
            elif finished_at is not None:
                changes.append((epoch(finished_at), -1, node))
    out: set[str] = set()
    levels = []
    for at, step, node in sorted(changes):
        (out.add if step > 0 else out.discard)(node)
        levels.append((at, len(out)))
    return levels


def run_fatal(
    nodes: int, fatal: int, breaker_percent: float = 25, replicas: int = REPLICAS
) -> dict[str, Any]:
    """Burst (b): more fatal nodes than the guardrails let out at once."""
    events, fatal_nodes = burst_events(nodes, fatal, 0)
    allowed, breaker_binds = allowed_out(nodes, breaker_percent)
    allowed = min(allowed, fatal)
    with tempfile.TemporaryDirectory(prefix="medic-policy-") as directory:
        policy = _levels_policy(breaker_percent, Path(directory))
        with fleet(nodes, replicas, policy) as f:
            f.post(events)
            f.until(lambda: max((n for _, n in out_over_time(f.store, f.since())), default=0) >= allowed)
            # Every incident decided: only then is "no more drains" a fact and not a backlog.
            decided_at = f.until(lambda: _decided(f, fatal_nodes) == fatal)
            levels = out_over_time(f.store, f.since())
            peak = max((n for _, n in levels), default=0)
            drained = f.drained()
            breaker = f.store.open_breaker_record()
            stopped = Counter(guardrail or "none" for guardrail in _stopped_by(f).values())
            opened_at = epoch(breaker.opened_at) if breaker else None
            return (
                f.common(events)
                | _contain(drained, f.posted)
                | {
                    "burst": "b",
                    "nodes": nodes,
                    "fatal": fatal,
                    "breaker_percent": breaker_percent,
                    "allowed": allowed,
                    "breaker_binds": breaker_binds,
                    "peak_out": peak,
                    "drained": len(drained),
                    "wrongly_drained": sorted(set(drained) - fatal_nodes)[:10],
                    "to_exact_s": next((at - f.started for at, n in levels if n >= allowed), None),
                    "all_decided_s": None if decided_at is None else decided_at - f.started,
                    "breaker": None if breaker is None else breaker.reason,
                    "breaker_opened_s": None if opened_at is None else opened_at - f.started,
                    "drains_after_breaker": 0
                    if opened_at is None
                    else sum(1 for at in drained.values() if at > opened_at),
                    "stopped_by_guardrail": dict(stopped),
                }
            )


def _stopped_by(f: Fleet) -> dict[str, str | None]:
    """Each incident opened in the burst that has a decision (by its subject), and the first
    guardrail any of its decisions names: the decision made to contain it, or the last check under
    the guardrail slot that stopped the drain, or a later one of its flow run."""
    from sqlmodel import col, select

    from medic.store.tables import DecisionRecord, IncidentRecord

    query = (
        select(IncidentRecord.node, DecisionRecord.guardrail)
        .join(DecisionRecord, col(DecisionRecord.incident_id) == col(IncidentRecord.id))
        .where(col(IncidentRecord.opened_at) >= f.since())
        .order_by(col(DecisionRecord.decided_at))
    )
    stopped: dict[str, str | None] = {}
    with f.store.session() as s:
        for node, guardrail in s.exec(query):
            if stopped.get(node) is None:
                stopped[node] = guardrail
    return stopped


def _decided(f: Fleet, nodes: set[str]) -> int:
    """How many of `nodes` have an incident with a decision."""
    return len(_stopped_by(f).keys() & nodes)


def run_storm(nodes: int, switches: int = STORM_SWITCHES, replicas: int = REPLICAS) -> dict[str, Any]:
    """Burst (c): a switch-tier storm, one switch-wide incident per switch and no node action."""
    events = storm_events(switches)
    subjects = {f"leaf-{s + 1}" for s in range(switches)}

    def switch_incidents() -> list[Any]:
        return [
            i for i in f.store.find_incidents(since=f.since(), limit=len(events) + 100) if i.scope == "switch"
        ]

    with fleet(nodes, replicas) as f:
        f.post(events)
        decided_at = f.until(lambda: _stopped_by(f).keys() >= subjects and not f.store.undispatched_events())
        found = switch_incidents()
        node_actions = f.store.actions_since(f.since(), ["drain", "reboot", "reset_gpu", "replace"])
        return f.common(events) | {
            "burst": "c",
            "nodes": nodes,
            "switches": switches,
            "switch_incidents": len(found),
            "switches_with_one_incident": sum(1 for _, n in Counter(i.node for i in found).items() if n == 1),
            "actions": dict(Counter(f"{i.action} ({i.status})" for i in found)),
            "node_incidents": dict(
                Counter(
                    f"{'+'.join(sorted({e.kind for e in f.store.incident_events(i.id)}))}: {i.action} ({i.status})"
                    for i in f.store.find_incidents(since=f.since())
                    if i.scope != "switch"
                )
            ),
            "node_actions": len(node_actions),
            "all_decided_s": None if decided_at is None else decided_at - f.started,
        }


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} s"


def render(result: dict[str, Any]) -> str:
    burst = result["burst"]
    if burst == "c":
        what = (
            f"{num(result['acknowledged'])} collective timeouts, all nodes of {result['switches']} switches"
        )
    else:
        what = f"{result['fatal']} fatal + {num(result.get('nonfatal', 0))} non-fatal"
    rows: list[tuple[str, str]] = [
        ("fleet / replicas", f"{num(result['nodes'])} simulated nodes / {result['replicas']}"),
        ("burst", f"{what}, posted in {result['posting_s']:.1f} s"),
        (
            "events acknowledged / stored (sent again after a reset connection)",
            f"{result['acknowledged']} / {result['stored']} ({result['resent']})",
        ),
    ]
    if burst == "a":
        rows += [
            (
                "nodes drained (exact set: the fatal ones)",
                f"{result['drained']}; wrong {result['wrongly_drained']}, missed {result['missed']}",
            ),
            ("first POST → exact set", _seconds(result["to_exact_s"])),
        ]
    elif burst == "b":
        rows += [
            (
                f"nodes taken out, returns not subtracted (allowed: {result['allowed']}, by the "
                + ("breaker" if result["breaker_binds"] else "out-of-service limit")
                + ")",
                str(result["peak_out"]),
            ),
            ("nodes drained in all", f"{result['drained']}; not fatal {result['wrongly_drained']}"),
            ("first POST → the allowed number out", _seconds(result["to_exact_s"])),
            ("first POST → every incident decided", _seconds(result["all_decided_s"])),
            ("breaker", result["breaker"] or "not opened"),
            (
                "first POST → breaker open / drains after it",
                f"{_seconds(result['breaker_opened_s'])} / {result['drains_after_breaker']}",
            ),
            ("incidents by the guardrail that stopped them", str(result["stopped_by_guardrail"])),
        ]
    else:
        rows += [
            (
                "switch incidents (one per switch) / node incidents",
                f"{result['switch_incidents']} ({result['switches_with_one_incident']}) / {sum(result['node_incidents'].values())}",
            ),
            ("their outcomes", str(result["actions"])),
            ("node incidents: their events and outcomes", str(result["node_incidents"])),
            ("node actions", str(result["node_actions"])),
            ("first POST → every switch decided", _seconds(result["all_decided_s"])),
        ]
    if burst != "c":
        rows.append(
            ("contain p50 / p99", f"{ms(result['contain_p50'] or 0)} / {ms(result['contain_p99'] or 0)}")
        )
    rows += [
        ("incidents / still being handled at the end", f"{result['incidents']} / {result['backlog']}"),
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
    replicas, dispatch = REPLICAS, "local"
    if "--replicas" in argv:
        at = argv.index("--replicas")
        replicas, argv = int(argv[at + 1]), argv[:at] + argv[at + 2 :]
    if "--dispatch" in argv:
        at = argv.index("--dispatch")
        dispatch, argv = argv[at + 1], argv[:at] + argv[at + 2 :]
    burst, numbers = (argv[0], [float(a) for a in argv[1:]]) if argv else ("a", [])
    if burst == "a":
        nodes, fatal, nonfatal = (int(n) for n in numbers or (NODES, FATAL, NONFATAL))
        result = run(nodes, fatal, nonfatal, replicas, dispatch)
    elif burst == "b":
        nodes, fatal = int(numbers[0]), int(numbers[1])
        result = run_fatal(nodes, fatal, numbers[2] if len(numbers) > 2 else 25, replicas)
    elif burst == "c":
        result = run_storm(int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else STORM_SWITCHES, replicas)
    else:
        raise SystemExit(__doc__)
    print(render(result))
    print(result)


if __name__ == "__main__":
    main(sys.argv[1:])
