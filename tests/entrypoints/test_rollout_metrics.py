"""The rollout report's totals on `medic serve`'s /metrics (medic/apps/server/metrics.py, RolloutCollector),
through the real endpoint, judged against the policy in force at each scrape."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from rollout_support import CANARY_POLICY, decide, seed

from medic.apps.server import metrics
from medic.apps.server.app import create_app
from medic.integrations.registry import Backends
from medic.policy.model import Action
from medic.policy.selectors import Mode
from medic.store import Store
from medic.tasks.runtime.process import Runtime

Labels = tuple[tuple[str, str], ...]


def rollout_samples(client: TestClient) -> dict[tuple[str, Labels], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for s in family.samples
        if s.name.startswith("medic_rollout_")
    }


def of(values: dict[tuple[str, Labels], float], group: str) -> dict[str, float]:
    """One group's figures: name (with the verdict, for medic_rollout_decisions) → value."""
    found = {}
    for (name, labels), value in values.items():
        tags = dict(labels)
        if tags["group"] == group:
            found[name + (f"/{tags['verdict']}" if "verdict" in tags else "")] = value
    return found


@pytest.fixture
def serving(
    sqlite_store: Store, sim_backends: Backends, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[TestClient, Path]:
    """The app with a runtime whose policy file the test edits, as `medic serve` runs it."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(CANARY_POLICY)
    monkeypatch.setattr("medic.tasks.runtime.process._current", Runtime(sqlite_store, sim_backends, policy))
    seed(sqlite_store, monkeypatch, datetime.now(UTC) - timedelta(days=10))
    return TestClient(create_app(sqlite_store, tokens={"t"}, hmac_secret=None, on_accepted=None)), policy


def test_each_group_s_record_judged_against_the_policy_in_force(
    serving: tuple[TestClient, Path],
) -> None:
    client, _ = serving
    with client:
        values = rollout_samples(client)
    assert of(values, "canary") == {
        "medic_rollout_decisions/agreed": 1,
        "medic_rollout_decisions/disagreed": 1,
        "medic_rollout_decisions/missed_by_people": 0,
        "medic_rollout_decisions/false_alarm": 1,
        "medic_rollout_decisions/pending": 0,
        "medic_rollout_our_misses": 1,  # gpu-009: in the canary's hostlist, no decision of ours
        "medic_rollout_destructive_disagreements": 1,
        "medic_rollout_agreement_ratio": pytest.approx(1 / 3),
        "medic_rollout_ready": 0,  # the canary's bar: agreement 50%
        "medic_rollout_saved_minutes": 90,
    }
    other = of(values, "*")
    assert (other["medic_rollout_our_misses"], other["medic_rollout_ready"]) == (0, 0)
    assert "medic_rollout_agreement_ratio" not in other  # nothing judged: no ratio, not a zero


def test_an_edit_of_the_bar_shows_at_the_next_scrape(serving: tuple[TestClient, Path]) -> None:
    client, policy = serving
    with client:
        assert of(rollout_samples(client), "canary")["medic_rollout_ready"] == 0
        policy.write_text(CANARY_POLICY.replace("min_agreement: 0.5", "min_agreement: 0.3"))
        assert of(rollout_samples(client), "canary")["medic_rollout_ready"] == 1


def test_scrapes_within_a_minute_share_one_report(
    serving: tuple[TestClient, Path], sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _ = serving
    built: list[object] = []
    build = Store.rollout_report
    monkeypatch.setattr(
        Store, "rollout_report", lambda self, *a, **k: built.append(1) or build(self, *a, **k)
    )
    with client:
        first = rollout_samples(client)
        assert rollout_samples(client) == first and len(built) == 1
        monkeypatch.setattr(metrics, "ROLLOUT_REFRESH_S", 0.0)  # as if a minute had gone by
        rollout_samples(client)
    assert len(built) == 2


def test_only_the_report_s_default_span_is_counted(
    serving: tuple[TestClient, Path], sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _ = serving
    long_ago = datetime.now(UTC) - timedelta(days=31)
    decide(sqlite_store, monkeypatch, "gpu-004", Action.REBOOT, Mode.OBSERVE, "canary", long_ago)
    with client:
        canary = of(rollout_samples(client), "canary")
    assert sum(v for k, v in canary.items() if k.startswith("medic_rollout_decisions/")) == 3


def test_without_a_policy_in_force_no_rollout_figure_is_shown(sqlite_store: Store) -> None:
    with TestClient(create_app(sqlite_store, tokens={"t"}, hmac_secret=None, on_accepted=None)) as client:
        assert rollout_samples(client) == {}
        assert client.get("/metrics").status_code == 200
