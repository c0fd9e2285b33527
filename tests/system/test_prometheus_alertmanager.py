"""A real Prometheus and a real Alertmanager feed `medic serve`: an XID that dcgm-exporter reports becomes
an incident and the node is drained, with nothing but the shipped alert rules and a webhook receiver.

Prometheus scrapes dcgm-exporter's recorded exposition (tests/fixtures/dcgm_exporter/) every second and
evaluates deployments/prometheus/dcgm-exporter.rules.yml every second; Alertmanager delivers to
`POST /v1/alertmanager` with a bearer token. The test sets GPU 0's last XID to 79 in the exposition and
reads the outcome from the store with SQL: the incident, its event (code 79, the alert's start as its
time), the node's drain; then the XID clears and the resolved alert changes nothing. About 30 s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_stack import running
from serve_process import TOKEN, free_port, server_process
from sqlalchemy import create_engine, text

pytestmark = pytest.mark.system

NODE = "gpu-node-1"  # the exporter's host 1, relabelled by Prometheus (tests/prometheus_stack.py)


def _until(what: Callable[[], Any], description: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = what()
        if found:
            return found
        assert time.monotonic() < deadline, f"no {description} after {timeout_s:g} s"
        time.sleep(0.1)


def test_an_xid_from_dcgm_exporter_through_prometheus_and_alertmanager_drains_the_node(
    tmp_path: Path,
) -> None:
    database, port = tmp_path / "medic.db", free_port()
    env = {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": "", "MEDIC_BACKENDS": "sim"}
    engine = create_engine(f"sqlite:///{database}")

    def rows(sql: str) -> list[Any]:
        with engine.connect() as connection:
            return list(connection.execute(text(sql), {"node": NODE}))

    with (
        server_process(database, port, env),
        running(tmp_path, port, TOKEN, (free_port(), free_port())) as stack,
    ):
        time.sleep(3)  # three scrapes and evaluations of a healthy GPU: nothing fires
        assert stack.firing() == [] and rows("SELECT id FROM events") == []

        stack.exporter.fault(79)
        faulted = time.monotonic()
        (event,) = _until(
            lambda: rows(
                "SELECT id, kind, gpu, attributes, incident_id, time FROM events WHERE node = :node"
            ),
            "event from Alertmanager in the store",
            60,
        )
        to_event = time.monotonic() - faulted
        incident = _until(
            lambda: rows("SELECT id FROM incidents WHERE node = :node"), "incident for the node", 60
        )[0][0]
        drained = _until(
            lambda: rows(
                "SELECT finished_at FROM actions WHERE node = :node AND action = 'drain' AND status = 'succeeded'"
            ),
            "drain of the node",
            120,
        )
        to_drain = time.monotonic() - faulted
        assert (
            event.kind == "xid" and event.gpu == 0 and '"code": 79' in str(event.attributes).replace("'", '"')
        )
        tied = rows("SELECT incident_id FROM events WHERE node = :node")
        assert tied == [(incident,)] and drained

        stack.exporter.fault(0)  # cleared: Alertmanager sends the resolved alert, which acts on nothing
        _until(lambda: not stack.firing(), "resolved alert in Alertmanager", 30)
        _until(
            lambda: (
                'medic_alertmanager_ignored_total{reason="resolved"} 1.0'
                in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            ),
            "resolved alert recorded by medic serve",
            30,
        )
        assert len(rows("SELECT id FROM incidents WHERE node = :node")) == 1
        assert len(rows("SELECT id FROM events WHERE node = :node")) == 1
    engine.dispose()
    print(f"XID in the exposition → event stored {to_event:.1f} s, → node drained {to_drain:.1f} s")
