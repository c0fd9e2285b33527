"""Sustained telemetry: a large job's step-timing reports through `medic serve` replicas.

Item 4 of issue 40. One training job of RANKS ranks (8 a node) reports its step timings as the
training hooks do (`medic/training/medic_hooks.py`, `timings_every=10`): one `step_timings`
report per rank per 10 steps, each in its own POST, every rank of a round before the next round.
One rank's own work is 1.5 times its peers'. Reports are offered at a fixed rate (events/s) for
SECONDS, over keep-alive connections; meanwhile a fatal XID is posted every PROBE_EVERY_S to a
node outside the job, and its POST → drain intent is the live path's containment under that load.

Measured: the rate acknowledged (a report is acknowledged once it is committed to the store), the
POST's latency, the peer detector's verdicts on the slow rank (one per round it completes) and
their lag (the round's last report acknowledged → the verdict stored), the containment, and each
replica's CPU and memory. A replica "holds" a rate when it acknowledges it as offered and its
verdicts keep pace: the last round judged within a round's time.

With replicas, each report goes to the replica `route` names: round robin as a plain load
balancer does, or by job (job j to replica j mod N, as a load balancer hashing the hooks'
`X-Medic-Job` header spreads jobs). The peer detector compares a job's ranks within one replica.

Real: HTTP, the replicas, PostgreSQL, Prefect's server (the straggler's and the probes' flow runs).
Simulated: the scheduler and provider, DCGM, chat. The load generator is a minimal asyncio HTTP/1.1
client of its own (prebuilt requests), so that it takes a small share of the 2 cores it shares.

`PYTHONPATH=tests python -m bench.telemetry RANKS RATE [RATE ...] [--seconds S] [--replicas N] [--route job|round]
[--jobs J]` (J jobs share the RANKS);
`PYTHONPATH=tests python -m bench.telemetry detector RANKS [RANKS ...]` times the peer detector alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.fleet_burst import fleet, rss_mb
from bench.ingest import cpu_seconds, percentile
from bench.live import TOKEN, Server, epoch, event_dict
from bench.report import ms, num, table

EVERY = 10  # steps a report covers: the hooks' timings_every
STEP_S = 5.0  # a large model's step
SLOWER = 1.5
CONNECTIONS = 16
SECONDS = 30.0
PROBE_EVERY_S = 2.0
QUIET_S = 15.0  # no new verdict for this long after the last report: no more will come
PROBE_NODES = 40
GPUS = 8
JOB = "llm-405b"
Key = tuple[int, int]  # (job, round)


def reports(ranks: int, rounds: int, start: datetime, jobs: int = 1) -> Iterator[tuple[Key, dict[str, Any]]]:
    """((job, round), report) for every rank of `jobs` jobs of `ranks` ranks in all, round after
    round, the jobs' reports interleaved; rank 1 of each job is slow."""
    size = ranks // jobs
    for r in range(rounds):
        first = r * EVERY
        at = (start + timedelta(seconds=first * STEP_S)).isoformat()
        for rank in range(size):
            work = 1.0 * (SLOWER if rank == 1 else 1.0)
            for j in range(jobs):
                event = event_dict(
                    f"t-{j}-{r}-{rank}",
                    "health_check",
                    f"gpu-node-{(j * size + rank) // GPUS + 1}",
                    gpu=rank % GPUS,
                    job=f"{JOB}-{j}",
                    rank=rank,
                    attributes={
                        "check": "step_timings",
                        "first_step": first,
                        "world_size": size,
                        "step_times_s": [STEP_S] * EVERY,
                        "compute_s": [round(work + 0.01 * ((s * (rank + 3)) % 5), 3) for s in range(EVERY)],
                    },
                )
                event["time"] = at
                yield (j, r), event


def _request(body: bytes, host: str) -> bytes:
    head = (
        f"POST /v1/events HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/x-ndjson\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
    writer.write(request)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    body = await reader.readexactly(length)
    if status != b"200" or json.loads(body)["accepted"] != 1:
        raise RuntimeError(f"POST answered {status.decode()}: {body[:300]!r}")


@dataclass
class Offered:
    rate: float
    sent: int
    acknowledged_s: float  # first send → last acknowledgement
    latencies: list[float]
    last_ack_of_round: dict[Key, float]


async def offer(urls: list[str], requests: list[tuple[Key, int, bytes]], rate: float) -> Offered:
    """Send each (round, replica, request) at its time on the schedule `rate` sets, over
    CONNECTIONS connections per replica; every one must be acknowledged."""
    queues: list[asyncio.Queue[tuple[Key, float, bytes] | None]] = [asyncio.Queue() for _ in urls]
    latencies: list[float] = []
    last_ack: dict[Key, float] = {}

    async def connection(url: str, queue: asyncio.Queue[tuple[Key, float, bytes] | None]) -> None:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while (item := await queue.get()) is not None:
                round_, due, request = item
                await _exchange(reader, writer, request)
                now = time.time()
                latencies.append(now - due)
                last_ack[round_] = max(last_ack.get(round_, 0.0), now)
        finally:
            writer.close()

    workers = [
        asyncio.create_task(connection(url, queue))
        for url, queue in zip(urls, queues, strict=True)
        for _ in range(CONNECTIONS)
    ]
    started = time.time()
    for i, (round_, replica, request) in enumerate(requests):
        due = started + i / rate
        if (wait := due - time.time()) > 0:
            await asyncio.sleep(wait)
        queues[replica].put_nowait((round_, max(due, time.time()), request))
    for queue in queues:
        for _ in range(CONNECTIONS):
            queue.put_nowait(None)
    await asyncio.gather(*workers)
    return Offered(rate, len(requests), time.time() - started, latencies, last_ack)


def _probe(servers: list[Server], nodes: list[str], stop: float) -> dict[str, float]:
    """A fatal XID on the next of `nodes` every PROBE_EVERY_S until `stop`; node → when posted."""
    posted: dict[str, float] = {}
    for i, node in enumerate(nodes):
        if time.time() >= stop:
            break
        posted[node] = time.time()
        servers[i % len(servers)].post(
            [event_dict(f"probe-{node}", "xid", node, gpu=0, attributes={"code": 79})]
        )
        time.sleep(max(0.0, posted[node] + PROBE_EVERY_S - time.time()))
    return posted


def run(
    ranks: int,
    rate: float,
    seconds: float = SECONDS,
    replicas: int = 1,
    route: str = "job",
    jobs: int = 1,
) -> dict[str, Any]:
    from medic.store.tables import EventRecord

    rounds = max(1, round(rate * seconds / ranks))
    job_nodes = -(-ranks // GPUS)
    probes = [f"gpu-node-{job_nodes + 1 + i}" for i in range(PROBE_NODES)]
    start = datetime.now(UTC) - timedelta(seconds=rounds * EVERY * STEP_S)
    with fleet(job_nodes + PROBE_NODES, replicas) as f:
        servers, store = f.servers, f.store
        host = servers[0].url.removeprefix("http://")
        requests = [
            (
                round_,
                (round_[0] if route == "job" else i) % replicas,
                _request((json.dumps(event) + "\n").encode(), host),
            )
            for i, (round_, event) in enumerate(reports(ranks, rounds, start, jobs))
        ]
        cpu_before = [cpu_seconds(s.process.pid) for s in servers]
        since = datetime.now(UTC)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            offering = pool.submit(asyncio.run, offer([s.url for s in servers], requests, rate))
            posted = _probe(servers, probes, time.time() + len(requests) / rate)
            result_offer = offering.result()
        cpu = [cpu_seconds(s.process.pid) - b for s, b in zip(servers, cpu_before, strict=True)]
        # The verdicts: one per round the detector completes (a round is 10 steps: min_steps).
        # Until all are in, or none came for QUIET_S (a detector that cannot judge names nobody).
        verdicts, quiet_until = _verdicts(store, since), time.monotonic() + QUIET_S
        while len(verdicts) < rounds * jobs and time.monotonic() < quiet_until:
            time.sleep(0.5)
            found = _verdicts(store, since)
            if len(found) > len(verdicts):
                verdicts, quiet_until = found, time.monotonic() + QUIET_S
        lags = [
            at - result_offer.last_ack_of_round[r]
            for r, at in verdicts.items()
            if r in result_offer.last_ack_of_round
        ]
        drains: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and set(drains) < set(posted):
            drains = {
                a.node: epoch(a.intent_at)
                for a in store.actions_since(since - timedelta(seconds=1), ["drain"])
            }
            time.sleep(0.2)
        contain = [drains[n] - posted[n] for n in posted if n in drains]
        stored = store.count(EventRecord)
        return {
            "ranks": ranks,
            "replicas": replicas,
            "route": route,
            "rate": rate,
            "reports": len(requests),
            "rounds": rounds,
            "jobs": jobs,
            "acknowledged_per_s": len(requests) / result_offer.acknowledged_s,
            "post_p50": percentile(result_offer.latencies, 0.5),
            "post_p99": percentile(result_offer.latencies, 0.99),
            "stored": stored,
            "verdicts": len(verdicts),
            "verdict_lag_p50": percentile(lags, 0.5) if lags else None,
            "verdict_lag_max": max(lags) if lags else None,
            "probes": len(posted),
            "probes_drained": len(contain),
            "contain_p50": percentile(contain, 0.5) if contain else None,
            "contain_p99": percentile(contain, 0.99) if contain else None,
            "cpu_per_1000": [1000 * c / len(requests) for c in cpu],
            "cpu_share": [c / result_offer.acknowledged_s for c in cpu],
        }


def _verdicts(store: Any, since: datetime) -> dict[Key, float]:
    """The detector's stragglers on the slow ranks, by (job, the round whose report completed it)."""
    from sqlmodel import col, select

    from medic.store.tables import EventRecord

    query = (
        select(EventRecord.job, EventRecord.iteration, EventRecord.received_at)
        .where(EventRecord.kind == "straggler")
        .where(EventRecord.rank == 1)
        .where(col(EventRecord.received_at) >= since)
    )
    with store.session() as s:
        return {
            (int(str(job).rsplit("-", 1)[1]), int(step) // EVERY): epoch(at)
            for job, step, at in s.exec(query)
            if step is not None and job is not None
        }


def render(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        lag = (
            "none"
            if r["verdict_lag_p50"] is None
            else f"{r['verdict_lag_p50']:.1f} / {r['verdict_lag_max']:.1f} s"
        )
        rows.append(
            (
                f"{num(r['rate'])}/s",
                f"{r['replicas']} ({r['route']})",
                f"{num(r['acknowledged_per_s'])}/s",
                f"{ms(r['post_p50'])} / {ms(r['post_p99'])}",
                f"{r['verdicts']} of {r['rounds'] * r['jobs']}",
                lag,
                f"{ms(r['contain_p50'] or 0)} / {ms(r['contain_p99'] or 0)} ({r['probes_drained']} of {r['probes']})",
                ", ".join(f"{c:.0%}" for c in r["cpu_share"]),
            )
        )
    return table(
        (
            "offered",
            "replicas (routing)",
            "acknowledged",
            "POST p50 / p99",
            "verdicts on the slow rank",
            "verdict lag p50 / max",
            "contain p50 / p99 (drained)",
            "replica CPU (of one core)",
        ),
        rows,
    )


def main(argv: list[str]) -> None:
    options = {"--seconds": str(SECONDS), "--replicas": "1", "--route": "job", "--jobs": "1"}
    args: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in options:
            options[arg] = next(it)
        else:
            args.append(arg)
    if args[0] == "detector":
        for size in args[1:]:
            print(detector(int(size)))
        return
    job, rates = int(args[0]), [float(a) for a in args[1:]]
    results = [
        run(
            job,
            rate,
            float(options["--seconds"]),
            int(options["--replicas"]),
            options["--route"],
            int(options["--jobs"]),
        )
        for rate in rates
    ]
    print(render(results))
    for result in results:
        print(result)


def detector(ranks: int, rounds: int = 2) -> dict[str, float]:
    """The peer detector alone, in this process: one job of `ranks` ranks, `rounds` report rounds.
    Seconds per report pushed (the last of each round judges the window) and the memory its state
    holds (resident, after against before, the reports built beforehand)."""
    from medic.events import FaultEvent
    from medic.peers import PeerDetector

    built = [FaultEvent.model_validate(e) for _, e in reports(ranks, rounds, datetime.now(UTC))]
    before = rss_mb(os.getpid())
    peers = PeerDetector()
    judged: list[float] = []
    started = time.perf_counter()
    for i, event in enumerate(built):
        if (i + 1) % ranks == 0:  # the report that completes the round: the judging one
            at = time.perf_counter()
            found = peers.push(event)
            judged.append(time.perf_counter() - at)
            assert [e.rank for e in found] == [1], found
        else:
            peers.push(event)
    elapsed = time.perf_counter() - started
    return {
        "ranks": ranks,
        "reports": len(built),
        "per_report_us": 1e6 * (elapsed - sum(judged)) / (len(built) - len(judged)),
        "judge_s": max(judged),
        "reports_per_s": len(built) / elapsed,
        "state_mb": rss_mb(os.getpid()) - before,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
