"""What people did to nodes is stored, never remediated (docs/decisions/0019-human-actions-as-events.md):
`node_state` events posted to `medic serve` reach the warm path and open nothing, a restart does not hand
them on again, `medic triage` decides nothing on them; and serve polls Slurm only beside a Slurm
scheduler."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from checkout import REPO_ROOT
from factories import event_dict, fault_event
from fastapi.testclient import TestClient

from medic.apps.cli.serve import people_watch
from medic.apps.server.app import create_app
from medic.apps.server.people import PeopleWatch
from medic.events import FaultEvent
from medic.flows.live import LiveDispatcher
from medic.integrations import registry
from medic.integrations.slurm import SlurmCli, SlurmScheduler
from medic.policy import load_policy
from medic.store import Store
from medic.tasks.runtime.process import Runtime
from medic.triage import stream

TOKEN = "ingest-token"
DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"


def people(node: str, change: str, **attributes: str) -> dict[str, object]:
    return event_dict(
        "node_state",
        id=f"slurm-{node}-{change}",
        node=node,
        at=datetime.now(UTC),
        source="slurm",
        change=change,
        **attributes,
    )


def test_posted_node_state_events_are_stored_and_never_remediated(
    sqlite_store: Store, live_dispatcher: Callable[..., LiveDispatcher]
) -> None:
    rt = Runtime(sqlite_store, registry.simulated()[0], DEFAULT_POLICY)
    dispatcher = live_dispatcher(rt)
    handed: list[list[FaultEvent]] = []

    async def on_accepted(events: list[FaultEvent]) -> None:
        handed.append(events)
        await dispatcher(events)

    body = [
        people("gpu-node-3", "drain", reason="admin: bad fan", reason_set_by="alice"),
        people("gpu-node-3", "reboot"),
        people("gpu-node-4", "down", reason="Not responding", reason_set_by="root"),
    ]
    app = create_app(sqlite_store, tokens={TOKEN}, hmac_secret=None, on_accepted=on_accepted)
    with TestClient(app) as client:
        answer = client.post("/v1/events", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200 and answer.json()["accepted"] == 3
        deadline = time.monotonic() + 10
        while not handed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [e.id for e in handed[0]] == [e["id"] for e in body]  # the warm path saw them ...
    assert sqlite_store.find_incidents() == []  # ... and opened nothing
    assert sqlite_store.unfinished_actions() == [] and sqlite_store.held_nodes() == []
    stored = {
        e.id: e for e in sqlite_store.events_between(datetime(2026, 1, 1, tzinfo=UTC), datetime.now(UTC))
    }
    assert stored["slurm-gpu-node-3-drain"].attributes["reason_set_by"] == "alice"
    assert sqlite_store.undispatched_events() == []  # a restart does not hand them on again


def test_triage_decides_nothing_on_what_people_did() -> None:
    events = [fault_event("node_state", id=f"p{n}", minutes=n, change="drain") for n in range(3)]
    assert list(stream(events, load_policy(DEFAULT_POLICY))) == []


def test_serve_polls_slurm_beside_a_slurm_scheduler_only(
    sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    simulated = registry.simulated()[0]
    slurm = registry.simulated()[0]
    slurm.scheduler = SlurmScheduler(SlurmCli("/etc/slurm/test.conf", timeout_s=30))
    monkeypatch.delenv("MEDIC_SLURM_WATCH_SECONDS", raising=False)
    assert people_watch(Runtime(sqlite_store, simulated, DEFAULT_POLICY)) is None
    watch = people_watch(Runtime(sqlite_store, slurm, DEFAULT_POLICY))
    assert watch is not None
    poller, every_s = watch
    assert isinstance(poller, PeopleWatch) and every_s == 30.0
    assert (poller.watch.cli.slurm_conf, poller.watch.cli.timeout_s) == ("/etc/slurm/test.conf", 30)
    monkeypatch.setenv("MEDIC_SLURM_WATCH_SECONDS", "10")
    watch = people_watch(Runtime(sqlite_store, slurm, DEFAULT_POLICY))
    assert watch is not None and watch[0].watch.cli.timeout_s == 10  # no poll outlives its interval
    monkeypatch.setenv("MEDIC_SLURM_WATCH_SECONDS", "0")
    assert people_watch(Runtime(sqlite_store, slurm, DEFAULT_POLICY)) is None
    monkeypatch.setenv("MEDIC_SLURM_WATCH_SECONDS", "often")
    with pytest.raises(ValueError, match="MEDIC_SLURM_WATCH_SECONDS='often'"):
        people_watch(Runtime(sqlite_store, slurm, DEFAULT_POLICY))
