"""A real Prometheus and a real Alertmanager in front of `medic serve`, for the system test and the benchmark.

Debian's `prometheus` (2.42) and `prometheus-alertmanager` (0.25) binaries, each in its own temporary
folder on free ports: Prometheus scrapes a tiny exporter serving dcgm-exporter's recorded exposition
(tests/fixtures/dcgm_exporter/) every second and evaluates the alert rules GPU Medic ships
(deployments/prometheus/dcgm-exporter.rules.yml) every second; Alertmanager sends what fires to
`POST /v1/alertmanager` with a bearer token, as an operator's receiver would (docs/prometheus.md).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from checkout import REPO_ROOT, TEST_FIXTURES

RULES = REPO_ROOT / "deployments" / "prometheus" / "dcgm-exporter.rules.yml"
EXPOSITION = TEST_FIXTURES / "dcgm_exporter" / "t4-metrics.prom"
RECORDED_HOST = "424773df46e0"  # the fixture's Hostname label
NODES = "gpu-node-"  # host k of the exporter is relabelled gpu-node-k, a simulated node
XID_LINE = "DCGM_FI_DEV_XID_ERRORS{"
PROMETHEUS, ALERTMANAGER = "prometheus", "prometheus-alertmanager"


class Exporter:
    """dcgm-exporter's recorded /metrics, served for `hosts` nodes (the recorded host's block once per
    host, its `Hostname` suffixed `-1`, `-2`, ...), with the last XID of a host's GPU 0 set by `fault`."""

    def __init__(self, hosts: int = 1) -> None:
        self.xids = dict.fromkeys(range(1, hosts + 1), 0)
        families = _families(EXPOSITION.read_text())

        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = "".join(
                    "".join(comments) + "".join(exporter.sample(sample, host) for host in exporter.xids)
                    for comments, sample in families
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def sample(self, line: str, host: int) -> str:
        line = line.replace(f'Hostname="{RECORDED_HOST}"', f'Hostname="{RECORDED_HOST}-{host}"')
        if line.startswith(XID_LINE):
            line = f"{line.rsplit(' ', 1)[0]} {self.xids[host]}\n"
        return line

    def fault(self, xid: int, host: int = 1) -> None:
        self.xids[host] = xid

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _families(text: str) -> list[tuple[list[str], str]]:
    """The exposition as (its # HELP and # TYPE lines, its one sample line) per metric family."""
    families: list[tuple[list[str], str]] = []
    comments: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith("#"):
            comments.append(line)
        elif line.strip():
            families.append((comments, line))
            comments = []
    return families


def _prometheus_config(exporter: int, alertmanager: int) -> str:
    # The site's relabelling: the exporter's host name becomes the scheduler's node name.
    return f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{RULES}"]
alerting:
  alertmanagers: [{{static_configs: [{{targets: ["127.0.0.1:{alertmanager}"]}}]}}]
scrape_configs:
  - job_name: dcgm-exporter
    static_configs: [{{targets: ["127.0.0.1:{exporter}"]}}]
    metric_relabel_configs:
      - {{source_labels: [Hostname], regex: '{RECORDED_HOST}-(\\d+)', target_label: Hostname, replacement: '{NODES}$1'}}
"""


def _alertmanager_config(medic_port: int, token: str) -> str:
    return f"""
route:
  receiver: gpu-medic
  group_by: [alertname, Hostname, gpu]
  group_wait: 0s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: gpu-medic
    webhook_configs:
      - url: http://127.0.0.1:{medic_port}/v1/alertmanager
        send_resolved: true
        http_config: {{authorization: {{credentials: "{token}"}}}}
"""


@dataclass
class Stack:
    exporter: Exporter
    prometheus: str  # base URL
    alertmanager: str

    def firing(self) -> list[dict[str, object]]:
        """The alerts Alertmanager holds now."""
        answer = httpx.get(f"{self.alertmanager}/api/v2/alerts", timeout=5)
        answer.raise_for_status()
        alerts: list[dict[str, object]] = answer.json()
        return alerts


def _ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise AssertionError(
                f"{process.args[0]} exited with {process.returncode}: {log.read_text()[-3000:]}"
            )
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{process.args[0]} not ready after {timeout_s} s: {log.read_text()[-3000:]}"
            )
        time.sleep(0.1)


@contextmanager
def running(
    workdir: Path, medic_port: int, token: str, ports: tuple[int, int], hosts: int = 1
) -> Iterator[Stack]:
    """The exporter (`hosts` nodes), Prometheus and Alertmanager, up and ready; stopped on the way out."""
    prometheus_port, alertmanager_port = ports
    exporter = Exporter(hosts)
    (workdir / "prometheus.yml").write_text(_prometheus_config(exporter.port, alertmanager_port))
    (workdir / "alertmanager.yml").write_text(_alertmanager_config(medic_port, token))
    commands = {
        "alertmanager": [
            ALERTMANAGER,
            f"--config.file={workdir / 'alertmanager.yml'}",
            f"--storage.path={workdir / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{alertmanager_port}",
            "--cluster.listen-address=",  # one Alertmanager: no gossip port
        ],
        "prometheus": [
            PROMETHEUS,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'prom-data'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
        ],
    }
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for name, command in commands.items():
            with (workdir / f"{name}.log").open("wb") as log:
                processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        am, prom = f"http://127.0.0.1:{alertmanager_port}", f"http://127.0.0.1:{prometheus_port}"
        _ready(f"{am}/-/ready", processes[0], workdir / "alertmanager.log")
        _ready(f"{prom}/-/ready", processes[1], workdir / "prometheus.log")
        yield Stack(exporter, prom, am)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        exporter.close()
