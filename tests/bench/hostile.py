"""Hostile input against a real `medic serve` (issue 15): what floods and malformed requests cost.

`medic serve` (the CLI, warm path, Prefect embedded, SQLite store, every credential set, all in a
temporary directory) in its own process on 127.0.0.1. In turn:

- 512 MB posted, unauthenticated, to the Slack callback: the serve process's peak RSS around it
  (its high-water mark is reset first, /proc/PID/clear_refs);
- 16 MB of junk lines with 3 valid events among them, posted once, authenticated: the time to
  the answer, its size, the rows the dead letter kept, the rejections it counted, the events stored;
- a Sentry webhook whose exception text is 1 MB of near-misses for every pattern: the answer's
  time, and `sentry.translate`'s alone (median of 5, in this process);
- MALFORMED malformed requests of 31 kinds (bad JSON, hostile values, bad CloudEvents, compressed
  bodies, no or wrong credentials on every route, wrong methods and paths) over CONNECTIONS
  connections at once: every answer by status class, and connections dropped.

`PYTHONPATH=tests python -m bench hostile` prints the markdown section. Nothing here imports what only this change
added, so the same file measures an earlier commit too (PYTHONPATH at a checkout of it).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import hmac
import json
import random
import sqlite3
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import REPO_ROOT
from bench.ingest import wait_ready
from bench.report import ms, num, table
from bench.sentry import MEDIC_SERVE
from bench.sentry import server_env as sentry_env
from medic.integrations.processes import free_port

MALFORMED = 3000
CONNECTIONS = 8
FLOOD_BYTES = 16 * 1000 * 1000
SLACK_FLOOD_BYTES = 512 << 20
JUNK_LINE = b"this is junk, not json!!\n"  # the flood: 16 MB of these wrote 645,120 rows
TOKEN = "bench-hostile-token"
HMAC_SECRET = "bench-hostile-hmac"
SENTRY_SECRET = "bench-hostile-sentry"
SLACK_SECRET = "bench-hostile-slack"
Request = tuple[str, str, dict[str, Any], bytes]  # method, path, headers (str or raw bytes), body


def server_env(directory: Path) -> dict[str, str]:
    return sentry_env(
        directory,
        MEDIC_INGEST_TOKENS=TOKEN,
        MEDIC_INGEST_HMAC_SECRET=HMAC_SECRET,
        MEDIC_SENTRY_CLIENT_SECRET=SENTRY_SECRET,
        SLACK_SIGNING_SECRET=SLACK_SECRET,
    )


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to the current RSS (Linux >= 4.0)


def _count(database: Path, table_name: str) -> int:
    with sqlite3.connect(database) as connection:
        return int(connection.execute(f"SELECT count(*) FROM {table_name}").fetchone()[0])


def _event(event_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": event_id,
        "time": datetime.now(UTC).isoformat(),
        "source": "bench",
        "kind": "xid",
        "node": "gpu-node-1",
        "attributes": {"code": 13},
    } | fields


def _signed_sentry(body: bytes, sent_at: int, secret: str = SENTRY_SECRET) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Sentry-Hook-Resource": "event_alert",
        "Sentry-Hook-Timestamp": str(sent_at),
        "Sentry-Hook-Signature": hmac.new(secret.encode(), body, hashlib.sha256).hexdigest(),
    }


def _signed_slack(body: bytes, sent_at: int) -> dict[str, str]:
    base = b"v0:" + str(sent_at).encode() + b":" + body
    digest = hmac.new(SLACK_SECRET.encode(), base, hashlib.sha256).hexdigest()
    return {
        "Content-Type": "application/x-www-form-urlencoded",
        "X-Slack-Request-Timestamp": str(sent_at),
        "X-Slack-Signature": f"v0={digest}",
    }


def malformed(count: int) -> tuple[list[Request], int]:
    """`count` malformed requests, the kinds below in turn, each varied by its number; and how many kinds."""
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    json_type = bearer | {"Content-Type": "application/json"}
    lines = bearer | {"Content-Type": "application/x-ndjson"}
    now = int(time.time())

    def body(i: int, **fields: Any) -> bytes:
        return json.dumps(_event(f"bad-{i}", **fields)).encode()

    def binary(i: int, **headers: str) -> dict[str, str]:
        ce = {"ce-specversion": "1.0", "ce-type": "xid", "ce-source": "b", "ce-time": "2025-03-01T12:00:00Z"}
        return json_type | ce | {"ce-id": f"ce-{i}"} | headers

    kinds = [
        lambda i: ("POST", "/v1/events", bearer, random.Random(i).randbytes(200)),
        lambda i: ("POST", "/v1/events", json_type, body(i)[: 10 + i % 60]),
        lambda i: ("POST", "/v1/events", json_type, b"[1, 2, 3]"),
        lambda i: ("POST", "/v1/events", json_type, b"[" * 10_000 + b"]" * 10_000),
        lambda i: (
            "POST",
            "/v1/events",
            json_type,
            body(i).replace(b'"code": 13', b'"code": ' + b"9" * 5000),
        ),
        lambda i: ("POST", "/v1/events", json_type, body(i).replace(b'"code": 13', b'"code": NaN')),
        lambda i: ("POST", "/v1/events", json_type, body(i, source="agent\\ud800").replace(b"\\\\", b"\\")),
        lambda i: ("POST", "/v1/events", json_type, body(i, node="gpu\\u0000").replace(b"\\\\", b"\\")),
        lambda i: ("POST", "/v1/events", json_type, body(i, time="0001-01-01T00:00:00+01:00")),
        lambda i: ("POST", "/v1/events", json_type, body(i, gpu=2**63)),
        lambda i: ("POST", "/v1/events", json_type, body(i, kind="quantum_flux")),
        lambda i: ("POST", "/v1/events", json_type, body(i, colour="red")),
        lambda i: ("POST", "/v1/events", lines, body(i, attributes={"code": 79, "m": "x" * 70_000})),
        lambda i: ("POST", "/v1/events", lines, b"junk\n" * 50),
        lambda i: (
            "POST",
            "/v1/events",
            bearer | {"Content-Type": "application/cloudevents+json"},
            json.dumps({"specversion": "0.3", "id": f"c{i}", "source": "s", "type": "xid"}).encode(),
        ),
        lambda i: ("POST", "/v1/events", binary(i, **{"ce-id": ""}), b'{"node": "gpu-node-1"}'),
        lambda i: ("POST", "/v1/events", binary(i, **{"ce-source": "%C3%28"}), b'{"node": "gpu-node-1"}'),
        lambda i: ("POST", "/v1/events", json_type | {"Content-Encoding": "gzip"}, gzip.compress(body(i))),
        lambda i: ("POST", "/v1/events", {"Content-Type": "application/json"}, body(i)),
        lambda i: ("POST", "/v1/events", {"Authorization": f"Bearer guess-{i}"}, body(i)),
        lambda i: ("POST", "/v1/events", {"X-Medic-Signature": "sha256=" + "0" * 64}, body(i)),
        lambda i: ("POST", "/v1/sentry", _signed_sentry(body(i), now, "guess"), body(i)),
        lambda i: ("POST", "/v1/sentry", _signed_sentry(b"not json", now), b"not json"),
        lambda i: ("POST", "/v1/sentry", _signed_sentry(body(i), now - 3600), body(i)),
        lambda i: ("POST", "/v1/slack/interactions", {}, b"payload=%7B%7D"),
        lambda i: ("POST", "/v1/slack/interactions", _signed_slack(b"no=payload", now), b"no=payload"),
        # What tests/entrypoints/test_http_fuzz.py found answered 500 before: a body not UTF-8 with any signature,
        # a signed payload that is no JSON object, a Sentry timestamp of "²" (which passes isdigit).
        lambda i: ("POST", "/v1/slack/interactions", _signed_slack(b"x", now), b"\xff" * (1 + i % 9)),
        lambda i: ("POST", "/v1/slack/interactions", _signed_slack(b"payload=null", now), b"payload=null"),
        lambda i: (
            "POST",
            "/v1/sentry",
            _signed_sentry(body(i), now) | {"Sentry-Hook-Timestamp": b"\xb2"},
            body(i),
        ),
        lambda i: (("GET", "PUT", "DELETE")[i % 3], "/v1/events", bearer, b""),
        lambda i: ("GET", f"/v1/nothing-{i}", {}, b""),
    ]
    return [kinds[i % len(kinds)](i) for i in range(count)], len(kinds)


async def _send_all(url: str, requests: list[Request], connections: int) -> tuple[Counter[str], float]:
    """Every request answered or dropped, over `connections` at once: outcomes by status class."""
    outcomes: Counter[str] = Counter()
    pending: Iterator[Request] = iter(requests)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)

    async def worker(client: httpx.AsyncClient) -> None:
        for method, path, headers, body in pending:
            try:
                response = await client.request(method, path, headers=headers, content=body or None)
            except httpx.TransportError:
                outcomes["dropped"] += 1
                continue
            outcomes[f"{response.status_code // 100}xx"] += 1
            outcomes[str(response.status_code)] += 1

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(connections)))
        return outcomes, time.perf_counter() - started


def _slack_flood(url: str, pid: int) -> dict[str, Any]:
    def stream() -> Iterator[bytes]:
        block = b"x" * (1 << 20)
        for _ in range(SLACK_FLOOD_BYTES >> 20):
            yield block

    before = _status_kb(pid, "VmRSS")
    _reset_peak(pid)
    started = time.perf_counter()
    try:
        status: int | None = httpx.post(
            f"{url}/v1/slack/interactions",
            content=stream(),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
            timeout=120,
        ).status_code
    except httpx.TransportError:  # refused before the body, then the connection closed under it
        status = None
    return {
        "status": status,
        "seconds": time.perf_counter() - started,
        "rss_before_kb": before,
        "peak_kb": _status_kb(pid, "VmHWM"),
    }


def _junk_flood(url: str, pid: int, database: Path) -> dict[str, Any]:
    valid = [
        json.dumps(_event(f"among-junk-{n}", node=f"gpu-node-{n + 2}")).encode() + b"\n" for n in range(3)
    ]
    per_gap = (FLOOD_BYTES - sum(map(len, valid))) // len(JUNK_LINE) // 3
    body = b"".join(v + JUNK_LINE * per_gap for v in valid)
    rows_before, events_before = _count(database, "rejected_events"), _count(database, "events")
    _reset_peak(pid)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-ndjson"}
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/events", content=body, headers=headers, timeout=600)
    seconds = time.perf_counter() - started
    reply = response.json()
    return {
        "body_bytes": len(body),
        "junk_lines": 3 * per_gap,
        "status": response.status_code,
        "seconds": seconds,
        "answer_bytes": len(response.content),
        "accepted": reply["accepted"],
        "rejected": reply.get("rejected_total", len(reply["rejected"])),
        "listed": len(reply["rejected"]),
        "rows": _count(database, "rejected_events") - rows_before,
        "stored": _count(database, "events") - events_before,
        "peak_kb": _status_kb(pid, "VmHWM"),
    }


def near_misses(size: int) -> str:
    """Text that starts every pattern of medic/apps/server/sentry.py's KINDS and completes none."""
    piece = "Xid (PCI:0000:3b:00) NCCL rank 3 loss is fine CUDA error: out of memory cudaErr "
    return (piece * (size // len(piece) + 1))[:size]


def _sentry_big(url: str) -> dict[str, Any]:
    from medic.apps.server.sentry import translate

    payload = json.loads((REPO_ROOT / "tests" / "fixtures" / "sentry" / "event_alert_nan.json").read_text())
    event = payload["data"]["event"]
    event["title"] = "RuntimeError"
    event["exception"] = {"values": [{"type": "RuntimeError", "value": near_misses(1 << 20)}]}
    body = json.dumps(payload).encode()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        translate(body, "event_alert", "bench")
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    response = httpx.post(
        f"{url}/v1/sentry", content=body, headers=_signed_sentry(body, int(time.time())), timeout=60
    )
    return {
        "body_bytes": len(body),
        "status": response.status_code,
        "seconds": time.perf_counter() - started,
        "translate_s": statistics.median(times),
    }


def run(count: int = MALFORMED, connections: int = CONNECTIONS) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="medic-bench-hostile-") as tmp:
        directory = Path(tmp)
        url = f"http://127.0.0.1:{free_port()}"
        log = (directory / "server.log").open("wb")
        server = subprocess.Popen(
            [*MEDIC_SERVE, "--port", url.rsplit(":", 1)[1], "--log-level", "warning"],
            env=server_env(directory),
            cwd=REPO_ROOT,
            stdout=log,
            stderr=log,
        )
        try:
            wait_ready(url, server, timeout_s=120)
            slack = _slack_flood(url, server.pid)
            junk = _junk_flood(url, server.pid, directory / "medic.db")
            sentry = _sentry_big(url)
            rows_before = _count(directory / "medic.db", "rejected_events")
            requests, kinds = malformed(count)
            outcomes, seconds = asyncio.run(_send_all(url, requests, connections))
            rows = _count(directory / "medic.db", "rejected_events") - rows_before
            alive = httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
    return {
        "count": count,
        "kinds": kinds,
        "connections": connections,
        "outcomes": dict(outcomes),
        "seconds": seconds,
        "rows": rows,
        "alive": alive,
        "slack": slack,
        "junk": junk,
        "sentry": sentry,
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _mb(kb: float) -> str:
    return f"{num(kb / 1024)} MB"


def section(r: dict[str, Any]) -> str:
    o, junk, sentry, slack = r["outcomes"], r["junk"], r["sentry"], r["slack"]
    codes = ", ".join(f"{code}: {o[code]:,}" for code in sorted(o) if code.isdigit())
    answered = ", ".join(f"{o.get(c, 0):,} {c}" for c in ("4xx", "5xx")) + "".join(
        f", {o[c]:,} {c}" for c in ("2xx", "3xx") if o.get(c)
    )
    rows = [
        [
            f"{r['count']:,} malformed requests, {r['kinds']} kinds, {r['connections']} connections",
            f"{answered} ({codes}); {o.get('dropped', 0)} connections dropped; {r['rows']:,} dead-letter rows; "
            f"{num(r['count'] / r['seconds'])} requests/s; /healthz after: {'200' if r['alive'] else 'down'}",
        ],
        [
            f"{junk['body_bytes'] / 1e6:.0f} MB of junk lines ({junk['junk_lines']:,}) with 3 valid events",
            f"{junk['status']} in {junk['seconds']:.1f} s; answer {num(junk['answer_bytes'] / 1024)} KB "
            f"({junk['listed']:,} reasons listed, {junk['rejected']:,} counted); {junk['rows']:,} dead-letter rows; "
            f"{junk['stored']} of 3 valid events stored; serve's peak RSS {_mb(junk['peak_kb'])}",
        ],
        [
            f"Sentry webhook with {sentry['body_bytes'] / 1e6:.1f} MB of exception text (near-misses)",
            f"{sentry['status']} in {ms(sentry['seconds'])}; matching it (`translate`, median of 5): "
            f"{ms(sentry['translate_s'])}",
        ],
        [
            f"{SLACK_FLOOD_BYTES >> 20} MB unauthenticated POST to /v1/slack/interactions",
            f"{slack['status'] or 'refused, connection closed'} in {slack['seconds']:.1f} s; serve's RSS "
            f"{_mb(slack['rss_before_kb'])} before, peak {_mb(slack['peak_kb'])} during",
        ],
    ]
    return "\n".join(
        [
            "## Reliability: hostile input",
            "",
            f"`PYTHONPATH=tests python -m bench hostile` (tests/bench/hostile.py), {r['when']}: a real `medic serve` (warm path, "
            "Prefect embedded, SQLite) on 127.0.0.1 with every credential set. Peak RSS is the serve "
            "process's high-water mark, reset before each measure.",
            "",
            table(["input", "outcome"], rows),
            "",
        ]
    )


if __name__ == "__main__":
    print(section(run()))
