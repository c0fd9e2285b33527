"""What the training hooks' HTTP sink costs a step, with GPU Medic up, slow and down.

One rank's `MedicHooks.step` is timed alone, call by call, over STEPS steps, reporting its step
timings every TIMINGS_EVERY steps (each report one event for the sink), against three intakes:

- up: a real `medic serve` (warm path, simulated backends, SQLite, authentication on as it demands)
  in its own process on 127.0.0.1, the hooks' token from MEDIC_TOKEN;
- slow: an HTTP server that answers every request after SLOW_S (2 s);
- down: a port nothing listens on (the connection refused at once).

Beside the sink of this checkout, the one before it (commit BEFORE, read from git: each event POSTed
on the caller's thread, no token), measured the same way. And what importing each hook library costs
(`python -X importtime`, the library's own line, median of IMPORTS).

`PYTHONPATH=tests python -m bench.hooks_sink` prints the markdown section.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import REPO_ROOT
from bench.ingest import percentile, wait_ready
from bench.report import table
from medic.integrations.processes import free_port

BEFORE = "f1082c2"  # the sink that POSTed on the step's thread
BEFORE_PATH = "deployments/training/medic_hooks.py"
STEPS = 200
TIMINGS_EVERY = 10
SLOW_S = 2.0
IMPORTS = 15
TOKEN = "bench-hooks-token"
MEDIC_SERVE = [sys.executable, "-c", "import typer; from medic.apps.cli.serve import serve; typer.run(serve)"]


def library_before(folder: Path) -> ModuleType:
    """The hook library as it was at BEFORE, loaded under a name of its own."""
    source = subprocess.run(
        ["git", "show", f"{BEFORE}:{BEFORE_PATH}"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = folder / "medic_hooks_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("medic_hooks_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _Slow(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(SLOW_S)
        self.send_response(202)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def slow_intake() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1/events"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def medic_serve(folder: Path) -> Iterator[str]:
    port = free_port()
    env = os.environ | {
        "MEDIC_DATABASE_URL": f"sqlite:///{folder / 'medic.db'}",
        "MEDIC_INGEST_TOKENS": TOKEN,
        "MEDIC_BACKENDS": "sim",
        "PREFECT_HOME": str(folder / "prefect"),
        "PREFECT_API_URL": "",
    }
    with (folder / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [*MEDIC_SERVE, "--port", str(port), "--log-level", "warning"], env=env, stdout=log, stderr=log
        )
    try:
        wait_ready(f"http://127.0.0.1:{port}", process)
        yield f"http://127.0.0.1:{port}/v1/events"
    finally:
        process.terminate()
        process.wait(timeout=30)


def step_costs(library: ModuleType, url: str) -> dict[str, Any]:
    """Each `hooks.step` call's time, and the whole loop's, for one rank reporting to `url`."""
    hooks = library.MedicHooks(
        job="bench-hooks", node="gpu-node-1", rank=0, sink=url, world_size=8, timings_every=TIMINGS_EVERY
    )
    costs = []
    began = time.perf_counter()
    for step in range(STEPS):
        start = time.perf_counter()
        hooks.step(step, 1.0, 0.05)
        costs.append(time.perf_counter() - start)
    loop_s = time.perf_counter() - began
    flush = getattr(hooks.sink, "flush", None)
    if callable(flush):
        flush(SLOW_S * 3)
    return {
        "median_us": statistics.median(costs) * 1e6,
        "p99_us": percentile(costs, 0.99) * 1e6,
        "max_us": max(costs) * 1e6,
        "loop_s": loop_s,
        "reports": STEPS // TIMINGS_EVERY,
        "delivered": getattr(hooks.sink, "delivered", None),
    }


def import_us(path: Path) -> float:
    """The library's own line of `python -X importtime` (cumulative, µs), median of IMPORTS."""
    runs = []
    for _ in range(IMPORTS):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", f"import {path.stem}"],
            cwd=path.parent,
            capture_output=True,
            text=True,
            check=True,
        )
        line = next(x for x in done.stderr.splitlines() if x.rstrip().endswith(f"| {path.stem}"))
        runs.append(float(line.split("|")[1]))
    return statistics.median(runs)


def run() -> dict[str, Any]:
    from medic.training import medic_hooks

    os.environ["MEDIC_TOKEN"] = TOKEN  # the new sink's token; the sink before sent none
    results: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="medic-bench-hooks-") as tmp:
        folder = Path(tmp)
        before = library_before(folder)
        now_copy = folder / "medic_hooks_now.py"
        now_copy.write_text(Path(medic_hooks.__file__).read_text())
        results["import_us"] = {
            "before": import_us(folder / "medic_hooks_before.py"),
            "now": import_us(now_copy),
        }
        results["load"] = os.getloadavg()[0]
        rows = {}
        with medic_serve(folder) as up, slow_intake() as slow:
            down = f"http://127.0.0.1:{free_port()}/v1/events"
            for name, url in (
                ("up (medic serve)", up),
                (f"slow ({SLOW_S:g} s answers)", slow),
                ("down", down),
            ):
                rows[name] = {"before": step_costs(before, url), "now": step_costs(medic_hooks, url)}
        results["rows"] = rows
    return results


def section(results: dict[str, Any]) -> str:
    rows = []
    for name, versions in results["rows"].items():
        for version, r in versions.items():
            label = f"{BEFORE} (on the step's thread)" if version == "before" else "now (background sender)"
            delivered = "" if r["delivered"] is None else f"{r['delivered']} of {r['reports']}"
            rows.append(
                [
                    name,
                    label,
                    f"{r['median_us']:.1f}",
                    f"{r['p99_us']:.0f}",
                    f"{r['max_us']:,.0f}",
                    f"{r['loop_s']:.2f}",
                    delivered,
                ]
            )
    imports = results["import_us"]
    return "\n".join(
        [
            "## The training hooks' HTTP sink: a step's cost with GPU Medic up, slow and down",
            "",
            f"`PYTHONPATH=tests python -m bench.hooks_sink` (tests/bench/hooks_sink.py), {results['when']}, "
            f"load average {results['load']:.2f} at start. One rank's `MedicHooks.step`, {STEPS} steps, a "
            f"step-timings report every {TIMINGS_EVERY} (one event each), each call timed alone (µs).",
            "",
            table(
                ["GPU Medic", "sink", "median µs", "p99 µs", "max µs", "loop s", "delivered (new sink)"],
                rows,
            ),
            "",
            f"Importing the hook library (`python -X importtime`, its own line, median of {IMPORTS}): "
            f"{imports['before']:.0f} µs before, {imports['now']:.0f} µs now.",
        ]
    )


if __name__ == "__main__":
    print(section(run()))
