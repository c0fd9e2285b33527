"""The senders GPU Medic ships against `medic serve` as a site runs it: authentication on (serve refuses
to start without it). The training hooks' HTTP sink, its token from the environment: their events
stored, a rank without the token refused once, said once, training on. The node agent's and the Slurm
hooks' sender (`sink_from`). (`medic emit`: tests/entrypoints/test_server.py; Alertmanager's receiver:
tests/entrypoints/test_alertmanager.py.)"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from factories import fault_event
from serve_process import TOKEN, free_port, server_process

from medic.integrations.sinks import TOKEN_ENV as SINK_TOKEN_ENV
from medic.integrations.sinks import URL_ENV, sink_from
from medic.store import Store
from medic.training.medic_hooks import TOKEN_ENV, HttpSink, MedicHooks

JOB, NODE = "llm-7b", "gpu-node-3"


def stored(database: Path, ids: list[str], timeout_s: float = 20) -> set[str]:
    store = Store(f"sqlite:///{database}")
    try:
        deadline = time.monotonic() + timeout_s
        while (found := store.known_event_ids(ids)) != set(ids) and time.monotonic() < deadline:
            time.sleep(0.2)
        return found
    finally:
        store.close()


def test_a_job_s_events_reach_an_authenticated_serve_and_a_rank_without_the_token_is_told_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": "", "MEDIC_BACKENDS": "sim"}
    database, port = tmp_path / "medic.db", free_port()
    url = f"http://127.0.0.1:{port}/v1/events"
    with server_process(database, port, env):
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        sink = HttpSink(url)
        ranks = [
            MedicHooks(job=JOB, node=NODE, rank=r, sink=sink, world_size=2, timings_every=5) for r in (0, 1)
        ]
        sent = []
        for step in range(10):
            for rank in ranks:
                sent += rank.step(step, 1.0, 0.2)
        sent += ranks[0].step(10, float("nan"), 0.2)  # a NaN loss
        sent.append(ranks[1].crash(134))  # flushed before it returns
        assert [e.kind.value for e in sent].count("health_check") == 4
        assert {"nan_loss", "job_crash"} <= {e.kind.value for e in sent}
        assert stored(database, [e.id for e in sent]) == {e.id for e in sent}
        assert sink.refused == sink.dropped == 0

        monkeypatch.delenv(TOKEN_ENV)
        stranger = MedicHooks(job=JOB, node=NODE, rank=2, sink=url)
        with caplog.at_level(logging.ERROR, logger="medic_hooks"):
            unsent = [stranger.event("nan_loss", iteration=i, loss="nan") for i in range(3)]
            stranger.flush()
            unsent.append(stranger.crash(1))
        assert stored(database, [e.id for e in unsent], timeout_s=1) == set()
        refusals = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(refusals) == 1 and "HTTP 401" in refusals[0], refusals


def test_the_node_agent_s_and_slurm_hooks_sender_reaches_an_authenticated_serve(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`medic agent` and the Slurm hooks send through `sink_from` ($MEDIC_URL, $MEDIC_TOKEN)."""
    env = {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": "", "MEDIC_BACKENDS": "sim"}
    database, port = tmp_path / "medic.db", free_port()
    base = f"http://127.0.0.1:{port}"
    with server_process(database, port, env):
        event = fault_event(node=NODE, id="agent-xid-1", gpu=3, code=79, source="agent")
        sink_from(None, {URL_ENV: base, SINK_TOKEN_ENV: TOKEN}).emit([event])
        assert stored(database, [event.id]) == {event.id}
        refused = fault_event(node=NODE, id="agent-xid-2", gpu=3, code=79, source="agent")
        with caplog.at_level(logging.ERROR):
            sink_from(None, {URL_ENV: base, SINK_TOKEN_ENV: "not-ours"}).emit([refused])
        assert stored(database, [refused.id], timeout_s=1) == set()
        assert "refused 1 events (HTTP 401)" in caplog.text
