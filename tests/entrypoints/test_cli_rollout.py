"""`medic rollout report` against a SQLite store written through the store's own methods."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from factories import fault_event
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.incidents import correlate
from medic.policy.model import Action, Classification, Decision
from medic.policy.selectors import Mode
from medic.store import Store

runner = CliRunner()
NOW = datetime.now(UTC).replace(microsecond=0)
DAY0 = NOW - timedelta(days=10)  # old enough for every would-have to be judged
GROUP_KEYS = {
    "name",
    "mode_now",
    "modes",
    "would_have",
    "agreed",
    "disagreed",
    "missed_by_people",
    "false_alarm",
    "pending",
    "destructive_disagreements",
    "our_misses",
    "saved_minutes_median",
    "saved_minutes_total",
    "readiness",
    "pairs",
    "missed",
}


def _decide(
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
    node: str,
    action: Action,
    mode: Mode,
    group: str | None,
    at: datetime,
) -> None:
    (incident,) = correlate([fault_event(node=node, at=at, minutes=-1)])
    store.record_events([incident])
    store.open_incident(incident)
    monkeypatch.setattr("medic.store.stages.utcnow", lambda: at)
    store.add_decision(
        Decision(
            incident=incident.id,
            classification=Classification.HARDWARE,
            action=action,
            rule="xid-fallen-off-bus",
            reason="XID 79",
            matched=["xid-fallen-off-bus"],
            policy_sha256="0" * 64,
            mode=mode,
            group=group,
        ),
        "policies/default.yaml",
    )


def _people(store: Store, node: str, change: str, at: datetime) -> None:
    store.record_accepted(
        [
            fault_event(
                "node_state",
                id=f"slurm-{node}-{change}-{int(at.timestamp())}",
                source="slurm",
                node=node,
                at=at,
                change=change,
            )
        ]
    )


@pytest.fixture
def store_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'medic.db'}"
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path))
    monkeypatch.setenv("MEDIC_DATABASE_URL", url)
    store = Store(url)
    store.record_modes(
        {"*": "remediate", "canary": "observe"}, by="sre", policy_path="p.yaml", policy_sha256="0" * 64
    )
    hour = timedelta(hours=1)
    # canary, observing: an agreed reboot (people 90 min later), a drain people answered with a reboot,
    # a replace people never did on a node that did not fail again, and a drain by people on a node
    # GPU Medic never decided on.
    _decide(store, monkeypatch, "gpu-001", Action.REBOOT, Mode.OBSERVE, "canary", DAY0)
    _people(store, "gpu-001", "reboot_requested", DAY0 + 1.5 * hour)
    _decide(store, monkeypatch, "gpu-002", Action.DRAIN, Mode.OBSERVE, "canary", DAY0 + hour)
    _people(store, "gpu-002", "reboot", DAY0 + 2 * hour)
    _decide(store, monkeypatch, "gpu-003", Action.REPLACE, Mode.OBSERVE, "canary", DAY0 + 2 * hour)
    _people(store, "gpu-009", "drain", DAY0 + 3 * hour)
    # the other nodes, remediated: acted on, never a would-have.
    _decide(store, monkeypatch, "gpu-100", Action.REBOOT, Mode.REMEDIATE, None, DAY0 + 4 * hour)
    store.close()
    return url


def rollout(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["rollout", "report", "--json", *args])
    assert result.exit_code == 0, result.output
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def test_json_is_a_versioned_contract(store_url: str) -> None:
    built = rollout()
    assert set(built) == {
        "schema_version",
        "generated_at",
        "since",
        "window_hours",
        "recurrence_days",
        "thresholds",
        "groups",
    }
    assert built["schema_version"] == 1
    assert built["thresholds"] == {"decisions": 50, "agreement": 0.95, "destructive_disagreements": 0}
    assert all(set(g) == GROUP_KEYS for g in built["groups"])


def test_each_group_with_its_mode_and_counts(store_url: str) -> None:
    groups = {g["name"]: g for g in rollout()["groups"]}
    canary, other = groups["canary"], groups["*"]
    assert canary["mode_now"] == "observe"
    assert [(m["mode"], m["decisions"]) for m in canary["modes"]] == [("observe", 3)]
    counts = ("would_have", "agreed", "disagreed", "false_alarm", "destructive_disagreements", "our_misses")
    assert {k: canary[k] for k in counts} == {
        "would_have": 3,
        "agreed": 1,
        "disagreed": 1,
        "false_alarm": 1,
        "destructive_disagreements": 1,
        "our_misses": 0,
    }
    assert canary["saved_minutes_total"] == 90
    assert canary["readiness"]["ready"] is False
    assert other["mode_now"] == "remediate"
    assert [(m["mode"], m["decisions"]) for m in other["modes"]] == [("remediate", 1)]
    assert (other["would_have"], other["our_misses"], other["missed"]) == (
        0,
        1,
        [f"slurm-gpu-009-drain-{int((DAY0 + timedelta(hours=3)).timestamp())}"],
    )


def test_group_filter_window_and_thresholds(store_url: str) -> None:
    (canary,) = rollout("--group", "canary", "--window-hours", "1", "--min-decisions", "3")["groups"]
    assert (canary["agreed"], canary["disagreed"], canary["false_alarm"]) == (0, 1, 2)
    assert canary["readiness"]["reasons"][0].startswith("agreement 0.0%")


def test_since_leaves_older_decisions_out(store_url: str) -> None:
    assert rollout("--since", "1d")["groups"] == []


def test_text_says_each_group_and_its_readiness(store_url: str) -> None:
    result = runner.invoke(app, ["rollout", "report"])
    assert result.exit_code == 0, result.output
    assert "group canary (mode now: observe; decisions by mode: observe 3)" in result.stdout
    assert "readiness: not ready: 3 would-have decisions, fewer than 50" in result.stdout


def test_a_bad_option_is_a_usage_error(store_url: str) -> None:
    assert runner.invoke(app, ["rollout", "report", "--min-agreement", "2"]).exit_code == 2
