"""The live path end to end: `medic serve` with the warm path, over real HTTP.

Two scenarios, each against its own server process (the ingest app under uvicorn with the
warm-path `LiveDispatcher`, as `medic serve` runs it; a SQLite store; Prefect in embedded mode
with its own temporary home; a simulated fleet):

- latency: XID 79 faults, each on its own node, posted at each of PACES after a warm-up
  fault. Measured per fault: from just before the POST to the drain's intent in the
  store (the first node action) and to the incident's close. The policy is the default
  without its guardrails: dozens of reboots in a minute are a storm the breaker (rightly)
  stops, and this measures the path, not the guardrails. The same at one fault a second with a
  Prefect server on PostgreSQL, through the deployment's trigger and a worker, and against a
  real local Slurm cluster (`medic serve` with MEDIC_SCHEDULER/MEDIC_PROVIDER=slurm).
- storm: STORM_EVENTS `nccl_timeout` events from all 32 nodes under one leaf switch, posted in
  batches over STORM_SECONDS, with the default policy, guardrails on. Counted afterwards:
  incidents, events stored and attached, node actions; timed: from the first POST to the
  incident's first decision.

`PYTHONPATH=tests python -m bench.live` prints the markdown section.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import IMPORT_ROOT, REPO_ROOT
from bench.flow_overhead import policy_without_guardrails
from bench.ingest import percentile, wait_ready
from bench.prefect_server import prefect_on_postgres
from bench.report import ms, num, table
from medic.integrations.processes import free_port

TOKEN = "bench-token"
SHARED_DRAINS_ENV = "BENCH_SHARED_DRAINS"  # replicas' simulated schedulers share drains (SharedDrains)
POSTGRES_ADMIN_URL = os.environ.get(
    "MEDIC_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
# (faults, seconds between them) on the embedded server: far enough apart that runs rarely overlap,
# one a second, then faster, to find the rate it sustains.
PACES = ((20, 3.0), (40, 1.0), (40, 0.5), (40, 0.25))
ONE_A_SECOND = PACES[1]  # the pace of the production server's and the real Slurm cluster's runs
TRIGGER = (6, 3.0)  # the scaled-out path: each flow run a fresh process on a worker on the same 2 cores
SLURM = (6, 1.0)  # a real Slurm cluster of 7 nodes (one for the warm-up)
STORM_EVENTS = 1000
STORM_SECONDS = 10.0
STORM_BATCHES = 50
SWITCH_NODES = 32


def serve(port: int, nodes: int, per_switch: int, policy: Path) -> None:
    """The server process: `medic serve`'s warm path with a simulated fleet of this shape."""
    from medic.apps.server.main import serve as run_server
    from medic.flows.live import LiveDispatcher
    from medic.integrations import registry
    from medic.integrations.sim.fleet import SimFleet
    from medic.store import Store
    from medic.tasks.runtime.process import Runtime, configure

    backends, _ = registry.simulated(SimFleet.build(nodes=nodes, per_switch=per_switch))
    store = Store(os.environ["MEDIC_DATABASE_URL"])
    if os.environ.get(SHARED_DRAINS_ENV):
        backends = dataclasses.replace(backends, scheduler=SharedDrains(backends.scheduler, store))
    rt = configure(Runtime(store, backends, policy))
    with LiveDispatcher(rt) as dispatcher:
        dispatcher.warm_up_in_background()
        run_server(port=port, on_accepted=dispatcher, log_level="warning", access_log=False)


class SharedDrains:
    """Replicas' simulated schedulers as one scheduler: a node another replica drained shows drained
    here too, as it does in one real scheduler that every replica asks (Slurm). Each replica holds
    its own simulated fleet; what the others drained is read from the store's record of their
    drains (an intent or a success). A node stays drained in the others' view once drained: the
    bursts end before a node returns. (`Store.taken_out_since`, which also counts reboots and
    failed intents, was tried instead: with it burst (b) drained 10 where its limit allows 15.) Without it, a replica's guardrails
    would see only its own drains, and two replicas would let out twice the limit between them."""

    def __init__(self, scheduler: Any, store: Any) -> None:
        self.scheduler, self.store = scheduler, store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    def nodes(self) -> list[Any]:
        drained = self._drained()
        return [self._over(n, drained) for n in self.scheduler.nodes()]

    def node(self, name: str) -> Any:
        return self._over(self.scheduler.node(name), self._drained({name}))

    def _drained(self, nodes: set[str] | None = None) -> set[str]:
        from sqlmodel import col, select

        from medic.store.tables import ActionRecord

        query = (
            select(ActionRecord.node)
            .where(ActionRecord.action == "drain")
            .where(col(ActionRecord.status).in_(["intent", "succeeded"]))
        )
        if nodes is not None:
            query = query.where(col(ActionRecord.node).in_(sorted(nodes)))
        with self.store.session() as s:
            return set(s.exec(query).all())

    @staticmethod
    def _over(info: Any, drained: set[str]) -> Any:
        from medic.protocols import NodeState

        if info.name not in drained or info.out_of_service:
            return info
        return dataclasses.replace(info, state=NodeState.DRAINED, reason="medic: drained by another replica")


def server_env(directory: Path, prefect_api: str | None) -> dict[str, str]:
    env = {
        **os.environ,
        "MEDIC_DATABASE_URL": f"sqlite:///{directory / 'medic.db'}",
        "MEDIC_INGEST_TOKENS": TOKEN,
        "MEDIC_HOME": str(directory / "home"),
        "PREFECT_HOME": str(directory / "prefect"),
        "PREFECT_LOGGING_LEVEL": "ERROR",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    return env


class Server:
    """`medic serve`'s app in its own process: by default this module's warm-path server with a
    fleet of the given shape; `command` runs another (`medic serve --dispatch prefect`)."""

    def __init__(
        self,
        directory: Path,
        nodes: int,
        per_switch: int,
        policy: Path,
        prefect_api: str | None = None,
        command: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        env = server_env(directory, prefect_api) | {"PYTHONPATH": IMPORT_ROOT} | (extra_env or {})
        self.database = env["MEDIC_DATABASE_URL"]
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        command = command or [
            sys.executable,
            "-m",
            "bench.live",
            "serve",
            str(nodes),
            str(per_switch),
            str(policy),
        ]
        self.log = directory / "server.log"
        with self.log.open("wb") as output:
            self.process = subprocess.Popen(
                [*command, "--port", port],
                env=env,
                cwd=REPO_ROOT,
                stdout=output,
                stderr=output,
            )
        self.client = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
        )

    def __enter__(self) -> Server:
        wait_ready(self.url, self.process, timeout_s=120)
        return self

    def __exit__(self, *_: object) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(timeout=60)

    def post(self, events: list[dict[str, Any]]) -> None:
        response = self.client.post("/v1/events", json=events)
        if response.status_code != 200 or response.json()["accepted"] != len(events):
            raise RuntimeError(f"POST answered {response.status_code}: {response.text}")

    def until(self, check: Callable[[], Any], what: str, timeout_s: float = 120) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (found := check()):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"no {what}: {self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        return found


def event_dict(event_id: str, kind: str, node: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": event_id,
        "time": datetime.now(UTC).isoformat(),
        "source": "bench",
        "kind": kind,
        "node": node,
    } | fields


def epoch(at: datetime) -> float:
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def _warm_up(server: Server, store: Any, node: str) -> None:
    """One fault handled end to end first: the service has been up a while in practice."""
    server.post([event_dict(f"warm-up-{node}", "xid", node, gpu=3, attributes={"code": 79})])
    server.until(lambda: any(i.closed_at for i in store.find_incidents(node=node)), "warm-up incident closed")


def _latency(directory: Path, prefect_api: str | None, faults: int, spacing_s: float) -> dict[str, Any]:
    policy = policy_without_guardrails(directory)
    with Server(directory, faults + 8, 8, policy, prefect_api) as server:
        return _measure(server, faults, spacing_s)


def _trigger_latency(directory: Path, prefect_api: str, faults: int, spacing_s: float) -> dict[str, Any]:
    """The scaled-out path: `medic serve --dispatch prefect`, the deployment's trigger, a process
    worker polling every second (Prefect's default is 10 s), each run in a fresh flow process."""
    policy = policy_without_guardrails(directory)
    env = server_env(directory, prefect_api) | {
        "MEDIC_BACKENDS": "sim",  # the service and the worker's flow runs, each its own simulated fleet
        "MEDIC_SIM_NODES": str(TRIGGER[0] + 1),
        "MEDIC_POLICY": str(policy),
        "PREFECT_WORKER_QUERY_SECONDS": "1",
    }
    with (
        process_worker(directory, env),
        Server(directory, 8, 4, policy, prefect_api, command=SERVE_PREFECT, extra_env=env) as server,
    ):
        return _measure(server, faults, spacing_s)


SERVE_PREFECT = [
    str(Path(sys.executable).parent / "medic"),
    "serve",
    "--dispatch",
    "prefect",
    "--log-level",
    "warning",
]


@contextmanager
def process_worker(directory: Path, env: dict[str, str]) -> Iterator[None]:
    """The `medic` process work pool, the repository's deployments, and a process worker on them
    (each flow run a fresh process), on the Prefect API `env` names."""
    prefect = [sys.executable, "-m", "prefect"]
    for args in (["work-pool", "create", "medic", "--type", "process"], ["--no-prompt", "deploy", "--all"]):
        prefect_file = ["--prefect-file", "deployments/prefect.yaml"] if "deploy" in args else []
        subprocess.run(
            [*prefect, *args, *prefect_file], env=env, cwd=REPO_ROOT, check=True, capture_output=True
        )
    with (directory / "worker.log").open("wb") as output:
        worker = subprocess.Popen(
            [*prefect, "worker", "start", "--pool", "medic", "--type", "process"],
            env=env,
            stdout=output,
            stderr=output,
        )
    try:
        yield
    finally:
        worker.terminate()
        worker.wait(timeout=60)


@contextmanager
def slurm_cluster(nodes: int) -> Iterator[Path]:
    """A real local Slurm cluster (scripts/slurm-cluster.sh); yields its slurm.conf."""
    # Not in a private temporary directory: munged wants every directory above its socket searchable.
    base = Path(tempfile.mkdtemp(prefix="medic-bench-slurm-"))
    base.chmod(0o755)
    env = os.environ | {"SLURM_TEST_BASE": str(base), "SLURM_TEST_NODES": str(nodes)}
    script = str(REPO_ROOT / "scripts" / "slurm-cluster.sh")
    subprocess.run([script, "start"], env=env, check=True, timeout=120, capture_output=True)
    try:
        yield base / "etc" / "slurm.conf"
    finally:
        subprocess.run([script, "stop"], env=env, check=True, timeout=120, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _slurm_latency(directory: Path, faults: int, spacing_s: float) -> dict[str, Any]:
    """`medic serve` (warm path, Prefect embedded) draining and rebooting nodes of a real Slurm
    cluster: every scheduler read and the drain are real `scontrol` calls."""
    policy = policy_without_guardrails(directory)
    with slurm_cluster(faults + 1) as conf:
        env = {
            "MEDIC_BACKENDS": "sim",  # DCGM, chat and checkpoints; the scheduler and provider are Slurm
            "MEDIC_SCHEDULER": "slurm",
            "MEDIC_PROVIDER": "slurm",
            "MEDIC_POLICY": str(policy),
            "SLURM_CONF": str(conf),
        }
        medic = [str(Path(sys.executable).parent / "medic"), "serve", "--log-level", "warning"]
        with Server(directory, faults + 1, faults + 1, policy, command=medic, extra_env=env) as server:
            return _measure(server, faults, spacing_s)


def _measure(server: Server, faults: int, spacing_s: float) -> dict[str, Any]:
    from medic.store import Store

    store = Store(server.database)
    _warm_up(server, store, f"gpu-node-{faults + 1}")
    posted: dict[str, float] = {}
    for i in range(1, faults + 1):
        node = f"gpu-node-{i}"
        posted[node] = time.time()
        server.post([event_dict(f"fault-{i}", "xid", node, gpu=3, attributes={"code": 79})])
        time.sleep(spacing_s)
    for node in posted:
        server.until(lambda node=node: any(i.closed_at for i in store.find_incidents(node=node)), "close")
    since = datetime(2000, 1, 1, tzinfo=UTC)
    drains = {a.node: epoch(a.intent_at) for a in store.actions_since(since, ["drain"])}
    to_close = {i.node: epoch(i.closed_at) for i in store.find_incidents() if i.closed_at}
    store.close()
    missing = sorted(set(posted) - set(drains))
    if missing:
        raise RuntimeError(f"no drain recorded for {missing}")
    return {
        "faults": faults,
        "spacing_s": spacing_s,
        "to_drain": [drains[n] - at for n, at in posted.items()],
        "to_close": [to_close[n] - at for n, at in posted.items()],
    }


def _storm(directory: Path) -> dict[str, Any]:
    from medic.store import Store
    from medic.store.tables import EventRecord

    policy = REPO_ROOT / "policies" / "default.yaml"
    with Server(directory, nodes=2 * SWITCH_NODES, per_switch=SWITCH_NODES, policy=policy) as server:
        store = Store(server.database)
        warm_up = f"gpu-node-{SWITCH_NODES + 1}"  # under leaf-2
        _warm_up(server, store, warm_up)
        under = [f"gpu-node-{n}" for n in range(1, SWITCH_NODES + 1)]  # leaf-1
        shuffled = random.Random(7)
        nodes = [under[i % SWITCH_NODES] for i in range(STORM_EVENTS)]
        shuffled.shuffle(nodes)
        events = [
            event_dict(f"storm-{i}", "nccl_timeout", node, switch="leaf-1", job="llm-70b", rank=i % 256)
            for i, node in enumerate(nodes)
        ]
        size = STORM_EVENTS // STORM_BATCHES
        started = time.time()
        for b in range(STORM_BATCHES):
            server.post(events[b * size : (b + 1) * size])
            time.sleep(max(0.0, started + (b + 1) * STORM_SECONDS / STORM_BATCHES - time.time()))
        posting_s = time.time() - started
        server.until(lambda: not store.undispatched_events(), "every event in an incident", timeout_s=60)

        def storm_incidents() -> list[Any]:
            found = [i for i in store.find_incidents() if i.node != warm_up]
            return found if found and all(i.closed_at for i in found) else []

        incidents = server.until(storm_incidents, "closed storm incidents")
        decided = min(epoch(d.decided_at) for i in incidents for d in store.incident_detail(i.id).decisions)
        result = {
            "events": STORM_EVENTS,
            "nodes": SWITCH_NODES,
            "posting_s": posting_s,
            "stored": store.count(EventRecord) - 1,  # the warm-up fault
            "incidents": [
                {
                    "scope": i.scope,
                    "subject": i.node,
                    "events": len(store.incident_events(i.id)),
                    "action": i.action,
                    "rule": i.rule,
                    "status": i.status,
                }
                for i in incidents
            ],
            "node_actions": sum(
                len(store.node_actions(node, datetime(2000, 1, 1, tzinfo=UTC))) for node in under
            ),
            "to_decision_s": decided - started,
        }
        store.close()
    return result


class _Rows(list[tuple[str, dict[str, Any]]]):
    """The latency rows, each also written to standard error as it comes: a run is long."""

    def append(self, row: tuple[str, dict[str, Any]]) -> None:
        super().append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)


def run() -> dict[str, Any]:
    latency = _Rows()
    for faults, spacing in PACES:
        with tempfile.TemporaryDirectory(prefix="medic-bench-live-") as tmp:
            latency.append(("Prefect embedded (SQLite)", _latency(Path(tmp), None, faults, spacing)))
    faults, spacing = ONE_A_SECOND
    with (
        tempfile.TemporaryDirectory(prefix="medic-bench-live-pg-") as tmp,
        prefect_on_postgres(Path(tmp) / "prefect-server", POSTGRES_ADMIN_URL) as api,
    ):
        latency.append(("Prefect server on PostgreSQL", _latency(Path(tmp), api, faults, spacing)))
    # A Prefect server of its own: after the in-process scenario's runs on the same server, the
    # trigger's runs have been seen not to close within the wait.
    with (
        tempfile.TemporaryDirectory(prefix="medic-bench-live-trigger-") as tmp,
        prefect_on_postgres(Path(tmp) / "prefect-server", POSTGRES_ADMIN_URL) as api,
    ):
        trigger = Path(tmp) / "trigger"
        trigger.mkdir()
        latency.append(
            (
                "Prefect server on PostgreSQL, `--dispatch prefect`: trigger → process worker",
                _trigger_latency(trigger, api, *TRIGGER),
            )
        )
    with tempfile.TemporaryDirectory(prefix="medic-bench-live-slurm-") as tmp:
        latency.append(("Prefect embedded (SQLite), real Slurm", _slurm_latency(Path(tmp), *SLURM)))
    with tempfile.TemporaryDirectory(prefix="medic-bench-storm-") as tmp:
        storm = _storm(Path(tmp))
    return {"latency": latency, "storm": storm}


def section(r: dict[str, Any]) -> str:
    storm = r["storm"]
    rows = [
        [name, f"{lat['faults']}, {lat['spacing_s']:g} s apart"]
        + [ms(percentile(lat["to_drain"], q)) for q in (0.5, 0.99)]
        + [ms(max(lat["to_drain"]))]
        + [ms(percentile(lat["to_close"], q)) for q in (0.5, 0.99)]
        for name, lat in r["latency"]
    ]
    (incident,) = storm["incidents"] if len(storm["incidents"]) == 1 else (None,)
    storm_rows = [
        [
            "events posted / stored",
            f"{storm['events']:,} in {num(storm['posting_s'])} s / {storm['stored']:,}",
        ],
        ["incidents", str(len(storm["incidents"]))],
        [
            "the incident",
            f"{incident['scope']} {incident['subject']}, {incident['events']:,} events, {incident['action']} "
            f"by {incident['rule']}, {incident['status']}"
            if incident
            else json.dumps(storm["incidents"]),
        ],
        ["node actions", str(storm["node_actions"])],
        ["first POST → decision", f"{num(storm['to_decision_s'])} s"],
    ]
    return "\n".join(
        [
            "## The live path (`medic serve`)",
            "",
            "A real uvicorn server with the in-process dispatcher, as `medic serve` runs it (its own process, "
            "SQLite store, simulated fleet), after one warm-up fault. "
            "XID 79 faults, each on its own node, posted at a steady pace; timed from just before each POST to "
            "the drain's intent in the store (the first node action: the service's containment, "
            "docs/decisions/0011) and to the incident's close (drain, reboot, "
            "job resume, DCGM L1 verify, reintegrate, notify). Default policy without guardrails. With Prefect's "
            "embedded server (`medic demo`'s setup) at rising rates, and with a real `prefect server` on "
            "PostgreSQL (production's); then the scaled-out path (`medic serve --dispatch prefect`, the "
            "deployment's trigger, a process worker polling every second instead of Prefect's default 10 s, each "
            "run in a fresh flow process); last, `medic serve` itself against a real local Slurm cluster "
            "(scripts/slurm-cluster.sh: every scheduler read, the drain and the reboot are `scontrol` calls; "
            "DCGM, chat and checkpoints simulated).",
            "",
            table(
                [
                    "Prefect API",
                    "faults",
                    "→ drain p50",
                    "→ drain p99",
                    "→ drain max",
                    "→ closed p50",
                    "→ closed p99",
                ],
                rows,
            ),
            "",
            f"Storm: {storm['events']:,} `nccl_timeout` events from all {storm['nodes']} nodes under one leaf switch, "
            f"in {STORM_BATCHES} batches over {STORM_SECONDS:g} s, after a warm-up fault under another switch; "
            "default policy with its guardrails (`storm_hold_seconds` 5), Prefect embedded.",
            "",
            table(["measure", "value"], storm_rows),
            "",
        ]
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        nodes, per_switch, policy, _, port = sys.argv[2:7]
        serve(int(port), int(nodes), int(per_switch), Path(policy))
    else:
        print(section(run()))
