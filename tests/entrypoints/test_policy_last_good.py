"""A broken edit of the live policy file, through `medic serve`'s own path: the last good policy
stays in force, every accepted event still gets its incident, and the refusal is said once in
the log, in /metrics and in each incident's Slack message until the file loads again."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from checkout import REPO_ROOT
from factories import event_dict
from fastapi.testclient import TestClient
from waiting import until

from medic.apps.server.app import create_app
from medic.flows.live import LiveDispatcher
from medic.integrations.registry import Backends
from medic.integrations.sim.notifier import RecordingNotifier
from medic.policy import load_policy
from medic.store import Store
from medic.tasks.runtime.process import Runtime, configure

pytestmark = pytest.mark.usefixtures("prefect_harness")

TOKEN = "ingest-token"


def scrape(client: TestClient) -> dict[str, str]:
    """The policy's lines of /metrics: name{labels} → value."""
    lines = client.get("/metrics").text.splitlines()
    return dict(line.rsplit(" ", 1) for line in lines if line.startswith("medic_policy"))


def test_a_broken_edit_keeps_the_last_good_policy_and_says_so_once(
    sqlite_store: Store,
    sim_backends: Backends,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    live_dispatcher: Callable[..., LiveDispatcher],
) -> None:
    policy = tmp_path / "policy.yaml"
    shutil.copy(REPO_ROOT / "policies" / "default.yaml", policy)
    good = load_policy(policy).sha256
    rt = configure(Runtime(sqlite_store, sim_backends, policy))
    notifier = rt.backends.notifier
    assert isinstance(notifier, RecordingNotifier)
    app = create_app(sqlite_store, tokens={TOKEN}, hmac_secret=None, on_accepted=live_dispatcher(rt))
    caplog.set_level(logging.INFO, logger="medic.runtime")

    def fault(node: str, kind: str = "xid", action: str = "reboot") -> str:
        answer = client.post(
            "/v1/events",
            json=event_dict(kind, id=f"lg-{node}", node=node, at=datetime.now(UTC)),
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert answer.status_code == 200 and answer.json()["accepted"] == 1
        closed = until(
            lambda: [i for i in sqlite_store.find_incidents(node=node) if i.status == "closed"],
            f"{node} closed",
        )
        (thread,) = [t for t in notifier.threads.values() if t.message.incident == closed[0].id]
        assert closed[0].action == action  # as the good policy says
        return thread.message.body

    with TestClient(app) as client:
        assert fault("gpu-node-1").count("Warning") == 0
        info = f'medic_policy_info{{path="{policy}",sha256="{good}"}}'
        assert scrape(client)["medic_policy_last_load_ok"] == "1.0"
        assert scrape(client)[info] == "1.0"

        text = policy.read_text()
        policy.write_text(text.replace("action: reboot", "action: rebooot", 1))
        # Two nodes, not three: the default breaker lets two out within five minutes.
        bodies = [fault("gpu-node-2"), fault("gpu-node-3", "nan_loss", "none")]
        for body in bodies:  # each incident's message says the edit did not take effect, and where
            assert f"Warning: policy edit refused, still using {good[:12]}: {policy}:" in body
            assert "rebooot" in body
        metrics = scrape(client)
        assert metrics["medic_policy_last_load_ok"] == "0.0"
        assert metrics[info] == "1.0"  # the last good policy, still in force
        assert float(metrics["medic_policy_loaded_timestamp_seconds"]) <= time.time()
        refused = [r for r in caplog.records if "policy edit refused" in r.getMessage()]
        assert [r.levelname for r in refused] == ["ERROR"]  # once for the change, not per event or read

        policy.write_text(text)
        assert scrape(client)["medic_policy_last_load_ok"] == "1.0"
        assert "Warning" not in fault("gpu-node-4", "nan_loss", "none")
    again = [r.getMessage() for r in caplog.records if "loads again" in r.getMessage()]
    assert again == [f"policy {policy} loads again: sha256 {good[:12]} in force"]
