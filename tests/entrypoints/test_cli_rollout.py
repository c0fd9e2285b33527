"""`medic rollout report` against a SQLite store written through the store's own methods."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from rollout_support import CANARY_POLICY, seed
from typer.testing import CliRunner

from medic.apps.cli.app import app
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
    "thresholds",
    "unplaced",
}


@pytest.fixture
def store_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'medic.db'}"
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path))
    monkeypatch.setenv("MEDIC_DATABASE_URL", url)
    store = Store(url)
    seed(store, monkeypatch, DAY0)
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


def test_thresholds_are_the_policys_each_group_its_own_and_an_option_wins(
    store_url: str, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(CANARY_POLICY)
    built = rollout("--policy", str(policy))
    assert built["thresholds"] == {"decisions": 10, "agreement": 0.5, "destructive_disagreements": 0}
    canary = next(g for g in built["groups"] if g["name"] == "canary")
    assert canary["thresholds"] == {"decisions": 3, "agreement": 0.5, "destructive_disagreements": 1}
    assert canary["readiness"]["reasons"] == ["agreement 33.3%, below 50%"]
    (forced,) = rollout("--policy", str(policy), "--group", "canary", "--min-agreement", "0.3")["groups"]
    assert forced["thresholds"] == {"decisions": 3, "agreement": 0.3, "destructive_disagreements": 1}
    assert forced["readiness"] == {"ready": True, "agreement": 1 / 3, "reasons": []}


def test_a_miss_is_placed_in_the_group_the_policy_names_its_node_in(store_url: str, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(CANARY_POLICY)
    groups = {g["name"]: g for g in rollout("--policy", str(policy))["groups"]}
    assert (groups["canary"]["our_misses"], groups["*"]["our_misses"]) == (1, 0)
    # A group on a fact the store does not keep: the node cannot be placed, and the report says why.
    policy.write_text(CANARY_POLICY.replace('hostlist: ["gpu-00[1-9]"]', "features: [canary]"))
    groups = {g["name"]: g for g in rollout("--policy", str(policy))["groups"]}
    assert groups["*"]["our_misses"] == 1 and groups["canary"]["our_misses"] == 0
    (unplaced,) = groups["*"]["unplaced"]
    assert unplaced["node"] == "gpu-009"
    assert unplaced["why"].startswith("cannot tell whether gpu-009 is in group canary")
    text = runner.invoke(app, ["rollout", "report", "--policy", str(policy)]).stdout
    assert "    not placed in a group: cannot tell whether gpu-009 is in group canary" in text


def test_a_policy_that_does_not_load_stops_the_report(store_url: str, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("readiness: {min_agreement: 2}\nrules: []\n")
    result = runner.invoke(app, ["rollout", "report", "--policy", str(policy)])
    assert result.exit_code == 2
    assert f"{policy}:1:" in result.output


def test_a_bad_option_is_a_usage_error(store_url: str) -> None:
    assert runner.invoke(app, ["rollout", "report", "--min-agreement", "2"]).exit_code == 2
