"""`medic audit verify` and `medic audit prune` (docs/cli.md#medic-audit) on a SQLite store in tmp_path."""

from __future__ import annotations

import gzip
import json
from datetime import timedelta
from pathlib import Path

import pytest
from audit_support import sql, work_incident
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.store import Store, utcnow

runner = CliRunner()


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    url = f"sqlite:///{tmp_path / 'medic.db'}"
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path))
    monkeypatch.setenv("MEDIC_DATABASE_URL", url)
    monkeypatch.setenv("COLUMNS", "400")
    store = Store(url)
    work_incident(store, "inc-old", "gpu-node-1", utcnow() - timedelta(days=100), close=True)
    work_incident(store, "inc-open", "gpu-node-2", utcnow() - timedelta(days=100), close=False)
    return store


def test_verify_says_ok_and_exits_0(store: Store) -> None:
    result = runner.invoke(app, ["audit", "verify"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("ok: ")


def test_verify_names_the_first_broken_link_and_exits_1(store: Store) -> None:
    sql(store, "UPDATE decisions SET rule = 'reboot-anyway' WHERE incident_id = 'inc-old'")

    result = runner.invoke(app, ["audit", "verify"])

    assert result.exit_code == 1
    assert "broken at seq" in result.stderr and "decisions" in result.stderr and "inc-old" in result.stderr
    shown = json.loads(runner.invoke(app, ["audit", "verify", "--json"]).stdout)
    assert shown["ok"] is False
    assert shown["problems"][0]["table"] == "decisions" and shown["problems"][0]["incident_id"] == "inc-old"


def test_verify_since_a_span(store: Store) -> None:
    result = runner.invoke(app, ["audit", "verify", "--since", "1h", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["entries"] > 0


def test_prune_then_verify_the_store_and_the_archive(store: Store, tmp_path: Path) -> None:
    archive = tmp_path / "audit.jsonl.gz"

    pruned = runner.invoke(app, ["audit", "prune", "--before", "30d", "--archive", str(archive)])

    assert pruned.exit_code == 0, pruned.output
    assert "archived 1 incidents" in pruned.stdout
    assert "kept 1 incidents still active" in pruned.stdout
    assert runner.invoke(app, ["audit", "verify"]).exit_code == 0
    checked = runner.invoke(app, ["audit", "verify", "--archive", str(archive)])
    assert checked.exit_code == 0, checked.output
    assert "recorded in the store as prune 1" in checked.stdout


def test_a_tampered_archive_exits_1(store: Store, tmp_path: Path) -> None:
    archive = tmp_path / "audit.jsonl.gz"
    runner.invoke(app, ["audit", "prune", "--before", "30d", "--archive", str(archive)])
    archive.write_bytes(gzip.compress(gzip.decompress(archive.read_bytes()).replace(b"alice", b"mallory")))

    result = runner.invoke(app, ["audit", "verify", "--archive", str(archive), "--json"])

    assert result.exit_code == 1
    assert "sha256" in json.loads(result.stdout)["problems"][0]["what"]


def test_prune_never_overwrites_an_archive(store: Store, tmp_path: Path) -> None:
    (tmp_path / "a.gz").write_text("an earlier archive")
    result = runner.invoke(app, ["audit", "prune", "--before", "30d", "--archive", str(tmp_path / "a.gz")])
    assert result.exit_code == 2
    assert "never overwritten" in result.stderr


def test_prune_refuses_a_broken_chain(store: Store, tmp_path: Path) -> None:
    sql(store, "DELETE FROM audit_chain WHERE seq = 2")
    result = runner.invoke(app, ["audit", "prune", "--before", "30d", "--archive", str(tmp_path / "a.gz")])
    assert result.exit_code == 1
    assert "refused: the audit chain does not verify" in result.stderr
    assert not (tmp_path / "a.gz").exists()
