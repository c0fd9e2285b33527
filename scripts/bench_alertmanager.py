#!/usr/bin/env python3
"""Alert → incident → drain through a real Prometheus and a real Alertmanager, printed as markdown
(docs/prometheus.md and BENCHMARKS.md are written from it).

The parts of tests/system/test_prometheus_alertmanager.py (tests/prometheus_stack.py): dcgm-exporter's
recorded exposition for N hosts, relabelled gpu-node-1..N; Prometheus scraping and evaluating the
shipped rules every second; Alertmanager (group_wait 0s) posting to `medic serve --dispatch local`
with the embedded Prefect server, simulated backends and the replicas' policy (no circuit breaker, no
cooldown, no approvals: tests/replicas_support.py). The service is warmed up first with one
fault (its embedded Prefect API starts on the first incident); then each of the other hosts reports
XID 79 in turn, the next once the last one's incident closed, and the figures are read from the store with SQL:

- XID in the exposition → event stored (scrape, rule evaluation, Alertmanager, the webhook);
- → incident opened; → node drained (containment, under the guardrail slot).

    .venv/bin/python scripts/bench_alertmanager.py --faults 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests")]  # the tests' harness, as pytest sees it

from prometheus_stack import running  # noqa: E402
from replicas_support import write_policy  # noqa: E402
from serve_process import TOKEN, free_port, server_process  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402


def _until(count: Any, sql: str, node: str, timeout_s: float = 120) -> float:
    """When the query first counts a row for the node."""
    deadline = time.monotonic() + timeout_s
    while not count(sql, node):
        if time.monotonic() > deadline:
            raise SystemExit(f"{node}: nothing for {sql!r} after {timeout_s:g} s")
        time.sleep(0.05)
    return time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=10, help="faults measured after the warm-up (10)")
    args = parser.parse_args()
    hosts = args.faults + 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        database, port = work / "medic.db", free_port()
        # No circuit breaker or cooldown: ten faults in a few minutes are a storm to the default policy.
        write_policy(work / "policy.yaml", max_out_of_service=hosts)
        env = {
            "MEDIC_POLICY": str(work / "policy.yaml"),
            "PREFECT_HOME": str(work / "prefect"),
            "PREFECT_API_URL": "",
            "MEDIC_BACKENDS": "sim",
            "MEDIC_SIM_NODES": str(hosts),
        }
        engine = create_engine(f"sqlite:///{database}")

        def count(sql: str, node: str) -> int:
            with engine.connect() as connection:
                return int(connection.execute(text(sql), {"node": node}).scalar_one())

        event = "SELECT count(*) FROM events WHERE node = :node"
        incident = "SELECT count(*) FROM incidents WHERE node = :node"
        drain = (
            "SELECT count(*) FROM actions WHERE node = :node AND action = 'drain' AND status = 'succeeded'"
        )
        closed = "SELECT count(*) FROM incidents WHERE node = :node AND closed_at IS NOT NULL"
        figures: dict[str, list[float]] = {"event stored": [], "incident opened": [], "node drained": []}
        started = time.monotonic()
        with (
            server_process(database, port, env),
            running(work, port, TOKEN, (free_port(), free_port()), hosts) as stack,
        ):
            for host in range(1, hosts + 1):
                node = f"gpu-node-{host}"
                stack.exporter.fault(79, host)
                at = time.monotonic()
                stored = _until(count, event, node)
                opened = _until(count, incident, node)
                drained = _until(count, drain, node)
                _until(count, closed, node)  # one fault at a time: the node is back before the next
                if host == 1:
                    warm_up = drained - at
                    continue  # the embedded Prefect API started on this one
                for name, when in zip(figures, (stored, opened, drained), strict=True):
                    figures[name].append(when - at)
        engine.dispose()
    took = time.monotonic() - started
    load = "/".join(f"{v:.2f}" for v in os.getloadavg()[:2])
    print(
        f"## Alertmanager → GPU Medic ({os.cpu_count()} cores, load {load} at the end, {took:.0f} s in all)\n"
    )
    print(
        f"{args.faults} XID 79s, one node after another, after a warm-up fault ({warm_up:.1f} s to its drain).\n"
    )
    print("| XID in dcgm-exporter's exposition → | median | max |")
    print("| --- | --- | --- |")
    for name, values in figures.items():
        print(f"| {name} | {statistics.median(values):.2f} s | {max(values):.2f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
