"""`medic policy check` and `medic schema` through the CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from checkout import REPO_ROOT
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.events import EventKind, FaultEvent
from medic.policy import load_policy

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"
UNKNOWN_KEY = textwrap.dedent(
    """\
    version: 1
    rules:
      - id: bus
        description: XID 79
        when:
          xid: [79]
          colour: red
        then: {classification: hardware, action: reboot}
    """
)

runner = CliRunner()


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")


def test_default_policy_is_ok() -> None:
    result = runner.invoke(app, ["policy", "check", str(DEFAULT_POLICY)])
    assert result.exit_code == 0, result.output
    rules = len(load_policy(DEFAULT_POLICY).policy.rules)
    assert f"{DEFAULT_POLICY}: ok ({rules} rules, sha256 " in result.stdout
    assert result.stderr == ""


def test_unknown_key_exits_1_with_file_line_column(tmp_path: Path) -> None:
    policy = tmp_path / "typo.yaml"
    policy.write_text(UNKNOWN_KEY, encoding="utf-8")
    result = runner.invoke(app, ["policy", "check", str(policy)])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [f"{policy}:7:7: rules.0.when.colour: unknown key"]
    assert ": ok" not in result.stdout


def test_every_file_is_checked_and_one_bad_one_fails_the_run(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("version: 1\nrules: [\n", encoding="utf-8")
    typo = tmp_path / "typo.yaml"
    typo.write_text(UNKNOWN_KEY, encoding="utf-8")
    result = runner.invoke(app, ["policy", "check", str(bad_yaml), str(DEFAULT_POLICY), str(typo)])
    assert result.exit_code == 1
    assert f"{DEFAULT_POLICY}: ok" in result.stdout
    errors = result.stderr.splitlines()
    assert len(errors) == 2
    assert errors[0].startswith(f"{bad_yaml}:3:1: invalid YAML")
    assert errors[1] == f"{typo}:7:7: rules.0.when.colour: unknown key"


def test_missing_file_fails(tmp_path: Path) -> None:
    result = runner.invoke(app, ["policy", "check", str(tmp_path / "absent.yaml")])
    assert result.exit_code == 1
    assert "absent.yaml" in result.stderr and "cannot read" in result.stderr


def test_schema_prints_the_event_json_schema() -> None:
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.stdout)
    assert schema == FaultEvent.model_json_schema()
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {
        "id",
        "time",
        "source",
        "kind",
        "node",
        "gpu",
        "job",
        "rank",
        "iteration",
        "switch",
        "attributes",
    }
    assert set(schema["required"]) == {"id", "time", "source", "kind", "node"}
    assert schema["properties"]["time"]["format"] == "date-time"
    assert schema["properties"]["kind"] == {"$ref": "#/$defs/EventKind"}
    assert schema["$defs"]["EventKind"]["enum"] == [k.value for k in EventKind]
