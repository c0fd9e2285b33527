"""Sustained ingest throughput of `medic serve` over real HTTP.

A real uvicorn server (`medic.apps.server.main.serve`, as `medic serve` runs it, access log on)
in its own process on 127.0.0.1 with a SQLite store in a temporary directory; a client in
this process posts JSON arrays of BATCH events over CONNECTIONS keep-alive connections.
Every request is answered only after its events are committed, so events/s is the durable
rate. Each round posts EVENTS new events; bodies are serialised before the clock starts.
After the rounds the store is counted: every acknowledged event must be there.

`PYTHONPATH=tests python -m bench.ingest` prints the markdown section.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from bench.report import Stats, ms, num, table
from medic.integrations.processes import free_port

EVENTS = 20_000
BATCH = 100
CONNECTIONS = 4
ROUNDS = 3
TOKEN = "bench-token"
KINDS = [
    ("xid", {"code": 79, "message": "GPU has fallen off the bus."}),
    ("ecc", {"dbe": 1, "sbe": 3}),
    ("straggler", {"step_time_ratio": 1.8}),
    ("thermal", {"temperature_c": 91.5, "throttle_reasons": ["hw_slowdown"]}),
]


def _bodies(round_no: int, count: int, batch: int) -> list[bytes]:
    start = datetime.now(UTC) - timedelta(hours=1)
    events = []
    for i in range(count):
        kind, attributes = KINDS[i % len(KINDS)]
        events.append(
            {
                "id": f"bench-{round_no}-{i}",
                "time": (start + timedelta(milliseconds=i)).isoformat(),
                "source": "agent",
                "kind": kind,
                "node": f"gpu-node-{i % 512:03d}",
                "gpu": i % 8,
                "job": f"train-{i % 16}",
                "attributes": attributes,
            }
        )
    return [json.dumps(events[i : i + batch]).encode() for i in range(0, count, batch)]


async def _post_all(url: str, bodies: list[bytes], connections: int) -> tuple[float, list[float], int]:
    """Post every body; returns (seconds, per-request latencies, events acknowledged)."""
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    latencies: list[float] = []
    acknowledged = 0
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal acknowledged
        while not queue.empty():
            body = queue.get_nowait()
            began = time.perf_counter()
            response = await client.post("/v1/events", content=body, headers=headers)
            latencies.append(time.perf_counter() - began)
            response.raise_for_status()
            acknowledged += response.json()["accepted"]

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(connections)))
        return time.perf_counter() - started, latencies, acknowledged


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server did not answer within {timeout_s} s")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]  # nearest rank


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc): robust to other load on the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(
    events: int = EVENTS, batch: int = BATCH, connections: int = CONNECTIONS, rounds: int = ROUNDS
) -> dict[str, Any]:
    from medic.store import Store
    from medic.store.tables import EventRecord

    with tempfile.TemporaryDirectory(prefix="medic-bench-ingest-") as tmp:
        database = f"sqlite:///{Path(tmp) / 'medic.db'}"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "MEDIC_DATABASE_URL": database, "MEDIC_INGEST_TOKENS": TOKEN}
        code = f"from medic.apps.server.main import serve; serve(port={port})"
        log = Path(tmp) / "server.log"
        with log.open("wb") as output:
            server = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=output, stderr=output)
        try:
            wait_ready(url, server)
            asyncio.run(_post_all(url, _bodies(-1, 10 * batch, batch), connections))  # warm-up
            seconds, latencies, acknowledged = [], [], 0
            cpu_before = cpu_seconds(server.pid)
            for round_no in range(rounds):
                bodies = _bodies(round_no, events, batch)
                took, round_latencies, round_acknowledged = asyncio.run(_post_all(url, bodies, connections))
                seconds.append(took)
                latencies += round_latencies
                acknowledged += round_acknowledged
            server_cpu = cpu_seconds(server.pid) - cpu_before
        finally:
            server.terminate()
            server.wait(timeout=30)
        server_log = log.read_text(errors="replace")
        store = Store(database)
        stored = store.count(EventRecord) - 10 * batch
        store.close()
    if acknowledged != events * rounds or stored != acknowledged:
        raise RuntimeError(
            f"sent {events * rounds}, acknowledged {acknowledged}, stored {stored}: {server_log[-2000:]}"
        )
    return {
        "events": events,
        "batch": batch,
        "connections": connections,
        "rounds": rounds,
        "seconds": seconds,
        "latencies": latencies,
        "stored": stored,
        "server_cpu_s": server_cpu,
    }


def section(r: dict[str, Any]) -> str:
    rates = Stats.of([r["events"] / s for s in r["seconds"]])
    latency = r["latencies"]
    rows = [
        ["events/s (durable)", num(rates.median), f"{num(rates.low)} - {num(rates.high)}"],
        ["request latency p50", ms(percentile(latency, 0.50)), ""],
        ["request latency p99", ms(percentile(latency, 0.99)), ""],
        ["server CPU per 1,000 events", ms(r["server_cpu_s"] * 1000 / (r["events"] * r["rounds"])), ""],
        ["requests", f"{len(latency):,}", ""],
        ["events stored and counted", f"{r['stored']:,}", ""],
    ]
    return "\n".join(
        [
            "## HTTP ingest (`medic serve`)",
            "",
            f"{r['rounds']} rounds of {r['events']:,} new events each, posted as JSON arrays of {r['batch']} over "
            f"{r['connections']} keep-alive connections to a real uvicorn server (its own process, SQLite store, "
            "access log on) on 127.0.0.1. A request is answered after its events are committed. "
            "Rate: median of the rounds (min - max); latency: over every request of every round; server CPU: "
            "user + system time of the server process over all rounds (the figure least moved by other load).",
            "",
            table(["measure", "value", "spread"], rows),
            "",
        ]
    )


if __name__ == "__main__":
    print(section(run()))
