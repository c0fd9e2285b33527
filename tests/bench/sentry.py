"""A burst of simultaneous Sentry webhooks against a real `medic serve`.

`medic serve` (the CLI, warm path, Prefect embedded, SQLite store, all in a temporary
directory) in its own process on 127.0.0.1, with only MEDIC_SENTRY_CLIENT_SECRET set. After one
webhook has been handled end to end (the service has been up a while in practice), BURSTS
bursts of BURST signed `event_alert` webhooks are sent at once, each on its own connection, as
Sentry's delivery workers would: each a NaN loss on its own node, so every one opens an
incident and a flow run in the same process while the others are still being answered.
Timed per webhook, from just before the request to its answer. Sentry counts an answer after
1 s as a timeout (and disables an integration after enough of them), hence the 1 s column.

`PYTHONPATH=tests python -m bench.sentry` prints the markdown section.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import REPO_ROOT
from bench.ingest import percentile, wait_ready
from bench.report import ms, table
from medic.integrations.processes import free_port

BURST = 40
BURSTS = 3
PAUSE_S = 10.0
SECRET = "bench-sentry-secret"
TEMPLATE = REPO_ROOT / "tests" / "fixtures" / "sentry" / "event_alert_nan.json"
# `medic serve`: its typer command in a process of its own, as the tests run it.
MEDIC_SERVE = [sys.executable, "-c", "import typer; from medic.apps.cli.serve import serve; typer.run(serve)"]


def webhook(name: str, node: str) -> tuple[bytes, dict[str, str]]:
    """A signed event_alert webhook (the test fixture's shape): a NaN loss on `node`."""
    payload = json.loads(TEMPLATE.read_text(encoding="utf-8"))
    event = payload["data"]["event"]
    event["event_id"] = hashlib.md5(name.encode()).hexdigest()  # an id, not a secret
    event["datetime"] = datetime.now(UTC).isoformat()
    event["tags"] = [["node", node], ["job", "bench"], ["rank", "0"], ["iteration", "100"]]
    body = json.dumps(payload).encode()
    headers = {
        "Content-Type": "application/json",
        "Request-ID": event["event_id"],
        "Sentry-Hook-Resource": "event_alert",
        "Sentry-Hook-Timestamp": str(int(time.time())),
        "Sentry-Hook-Signature": hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest(),
    }
    return body, headers


async def _burst(url: str, round_no: int, size: int) -> list[tuple[float, int]]:
    bodies = [webhook(f"burst-{round_no}-{i}", f"gpu-node-{round_no * size + i + 1}") for i in range(size)]

    async def one(client: httpx.AsyncClient, body: bytes, headers: dict[str, str]) -> tuple[float, int]:
        started = time.perf_counter()
        response = await client.post(f"{url}/v1/sentry", content=body, headers=headers)
        return time.perf_counter() - started, response.status_code

    # A client per webhook: a connection each, opened in the burst, as separate deliveries are.
    clients = [httpx.AsyncClient(timeout=60) for _ in bodies]
    try:
        return await asyncio.gather(*(one(c, b, h) for c, (b, h) in zip(clients, bodies, strict=True)))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


def server_env(directory: Path, **settings: str) -> dict[str, str]:
    """`medic serve`'s environment for a benchmark: simulated backends, a store and Prefect home of
    its own under `directory`, the embedded Prefect API; `settings` on top."""
    env = {
        **os.environ,
        "MEDIC_DATABASE_URL": f"sqlite:///{directory / 'medic.db'}",
        "MEDIC_BACKENDS": "sim",
        "MEDIC_HOME": str(directory / "home"),
        "PREFECT_HOME": str(directory / "prefect"),
        "PREFECT_LOGGING_LEVEL": "ERROR",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **settings,
    }
    env.pop("PREFECT_API_URL", None)
    return env


def run(burst: int = BURST, bursts: int = BURSTS) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="medic-bench-sentry-") as tmp:
        directory = Path(tmp)
        url = f"http://127.0.0.1:{free_port()}"
        log = (directory / "server.log").open("wb")
        server = subprocess.Popen(
            [*MEDIC_SERVE, "--port", url.rsplit(":", 1)[1], "--log-level", "warning"],
            env=server_env(
                directory,
                MEDIC_SENTRY_CLIENT_SECRET=SECRET,
                MEDIC_SIM_NODES=str(burst * bursts + 1),  # a node of the simulated fleet for every webhook
                MEDIC_INGEST_TOKENS="",
            ),
            cwd=REPO_ROOT,
            stdout=log,
            stderr=log,
        )
        try:
            wait_ready(url, server, timeout_s=120)
            body, headers = webhook("warm-up", f"gpu-node-{burst * bursts + 1}")
            httpx.post(f"{url}/v1/sentry", content=body, headers=headers, timeout=60).raise_for_status()
            time.sleep(PAUSE_S)  # its flow run, and the embedded Prefect server's start
            samples: list[tuple[float, int]] = []
            for round_no in range(bursts):
                samples += asyncio.run(_burst(url, round_no, burst))
                time.sleep(PAUSE_S)
            stopped = time.perf_counter()
            server.terminate()
            try:
                server.wait(timeout=60)
                stop_s: float | None = time.perf_counter() - stopped
            except subprocess.TimeoutExpired:
                stop_s = None
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
            log.close()
    latencies = [s for s, _ in samples]
    return {
        "burst": burst,
        "bursts": bursts,
        "latencies": latencies,
        "statuses": sorted({code for _, code in samples}),
        "over_1s": sum(1 for s in latencies if s > 1.0),
        "stop_s": stop_s,
        "exit": server.returncode,
        "when": datetime.now(UTC).strftime("%Y-%m-%d"),
    }


def section(r: dict[str, Any]) -> str:
    latency = r["latencies"]
    rows = [
        [
            f"{r['bursts']} bursts of {r['burst']}",
            ms(percentile(latency, 0.50)),
            ms(percentile(latency, 0.99)),
            ms(max(latency)),
            f"{r['over_1s']} of {len(latency)}",
            ", ".join(map(str, r["statuses"])),
        ]
    ]
    return "\n".join(
        [
            "## Sentry burst (`POST /v1/sentry`)",
            "",
            f"`PYTHONPATH=tests python -m bench sentry`, {r['when']}: a real `medic serve` (warm path, Prefect embedded, "
            "SQLite) on 127.0.0.1, one webhook handled first, then bursts of "
            f"{r['burst']} signed `event_alert` webhooks sent at once, {PAUSE_S:.0f} s apart, each a NaN "
            "loss on its own node (an incident and a flow run each, in the same process). Latency per "
            "webhook, from the request to its answer; Sentry counts more than 1 s as a timeout. "
            "SIGTERM after the last burst: "
            + (
                f"exit {r['exit']} in {r['stop_s']:.1f} s."
                if r["stop_s"] is not None
                else "still running after 60 s."
            ),
            "",
            table(["webhooks", "p50", "p99", "max", "> 1 s", "statuses"], rows),
            "",
        ]
    )


if __name__ == "__main__":
    print(section(run()))
