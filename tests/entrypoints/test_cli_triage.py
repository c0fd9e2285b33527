"""`medic triage`: the `--json` contract (docs/triage.md), rejections, policy errors, no Prefect."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

import pytest
from checkout import REPO_ROOT
from factories import event_line
from groups_support import write_grouped
from rich.console import Console
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.policy import Mode
from medic.policy.model import Action, Classification
from medic.triage import TriageLine

# The keys of schema version 1 as first published: never renamed, removed or retyped.
FIRST_KEYS = {"incident", "nodes", "classification", "action", "diagnose_level", "rule", "reason"}
# Keys added since, within version 1 (additive: consumers ignore keys they do not know).
ADDED_KEYS = {"group", "mode", "group_problem"}
CONTRACT_KEYS = FIRST_KEYS | ADDED_KEYS
# As documented in docs/triage.md: changing these sets is a contract change.
CLASSIFICATIONS = {"hardware", "software", "infrastructure", "unknown"}
ACTIONS = {"none", "diagnose", "reset_gpu", "reboot", "replace", "drain", "reintegrate", "escalate"}
MODES = {"observe", "contain", "remediate"}

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("cli_env")


def ev(event_id: str, kind: str, **fields: Any) -> str:
    return event_line(kind, id=event_id, **fields)


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def triage_json(*args: str) -> tuple[list[dict[str, Any]], Any]:
    result = runner.invoke(app, ["triage", *args, "--json"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    return [json.loads(line) for line in lines], result


def test_json_contract_keys_types_and_enums(tmp_path: Path) -> None:
    events = write(
        tmp_path / "events.jsonl",
        [
            ev("a-1", "xid", node="gpu-001", gpu=3, attributes={"code": 79}),
            ev(
                "a-2", "dcgm_health", node="gpu-002", attributes={"error_id": "DCGM_FR_VOLATILE_DBE_DETECTED"}
            ),
            ev("a-3", "nccl_timeout", node="gpu-003", job="48213", rank=24),
            ev("a-4", "nan_loss", node="gpu-004", job="48213", rank=0, iteration=15200),
            ev("a-5", "node_unreachable", node="gpu-005", switch="leaf-04"),
            ev("a-6", "thermal", node="gpu-006", attributes={"temperature_c": 91.5}),
        ],
    )
    result = runner.invoke(app, ["triage", str(events), "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert result.stdout.endswith("\n")
    raw_lines = result.stdout.splitlines()
    assert len(raw_lines) == 6  # one line per incident, one incident per node here
    for raw in raw_lines:
        line = json.loads(raw)
        assert isinstance(line, dict)
        assert set(line) == CONTRACT_KEYS
        assert re.fullmatch(r"inc-[0-9a-f]{10}", line["incident"])
        assert isinstance(line["nodes"], list) and line["nodes"]
        assert all(isinstance(node, str) for node in line["nodes"])
        assert line["classification"] in CLASSIFICATIONS
        assert line["action"] in ACTIONS
        level = line["diagnose_level"]
        if line["action"] == "diagnose":
            assert type(level) is int and 1 <= level <= 4
        else:
            assert level is None
        assert isinstance(line["rule"], str) and line["rule"]
        assert isinstance(line["reason"], str) and line["reason"]
        # The default policy has no groups: every node in none, remediated as before groups.
        assert (line["group"], line["mode"], line["group_problem"]) == (None, "remediate", None)
    by_node = {json.loads(raw)["nodes"][0]: json.loads(raw) for raw in raw_lines}
    assert set(by_node) == {f"gpu-00{i}" for i in range(1, 7)}
    assert by_node["gpu-003"]["action"] == "diagnose"
    assert by_node["gpu-003"]["diagnose_level"] == 1
    assert by_node["gpu-006"]["rule"] == "default"  # no rule matched: still one line


def test_contract_model_matches_the_documented_enums() -> None:
    """TriageLine, the policy enums and docs/triage.md must agree on every value."""
    hints = typing.get_type_hints(TriageLine)
    assert set(TriageLine.model_fields) == CONTRACT_KEYS
    assert (
        set(typing.get_args(hints["classification"])) == CLASSIFICATIONS == {c.value for c in Classification}
    )
    assert set(typing.get_args(hints["action"])) == ACTIONS == {a.value for a in Action}
    assert set(typing.get_args(hints["mode"])) == MODES == {m.value for m in Mode}
    doc = (REPO_ROOT / "docs" / "triage.md").read_text(encoding="utf-8")
    for value in CONTRACT_KEYS | CLASSIFICATIONS | ACTIONS | MODES:
        assert f"`{value}`" in doc, value


def test_xid_79_storm_on_one_node_is_one_reboot(tmp_path: Path) -> None:
    storm = [ev(f"xid-{i}", "xid", seconds=i, gpu=i % 8, attributes={"code": 79}) for i in range(50)]
    lines, _ = triage_json(str(write(tmp_path / "storm.jsonl", storm)))
    assert len(lines) == 1
    (line,) = lines
    assert line["nodes"] == ["gpu-017"]
    assert line["action"] == "reboot"
    assert line["rule"] == "xid-fallen-off-bus"
    assert line["classification"] == "hardware"
    assert line["diagnose_level"] is None


def test_nan_loss_is_software_and_no_action(tmp_path: Path) -> None:
    lines, _ = triage_json(str(write(tmp_path / "nan.jsonl", [ev("nan-1", "nan_loss", job="48213", rank=0)])))
    assert len(lines) == 1
    assert (lines[0]["classification"], lines[0]["action"]) == ("software", "none")


def test_malformed_lines_go_to_stderr_and_the_rest_is_triaged(tmp_path: Path) -> None:
    events = write(
        tmp_path / "mixed.jsonl",
        [
            ev("ok-1", "xid", node="gpu-001", attributes={"code": 79}),
            "this is not json",
            ev("bad-time", "nan_loss").replace("Z", ""),
            "[1, 2, 3]",
            "",  # blank: skipped, not rejected, but still counted as a line
            ev("ok-2", "nan_loss", node="gpu-002"),
            ev("ok-2", "nan_loss", node="gpu-002"),  # repeated id
        ],
    )
    lines, result = triage_json(str(events))
    assert result.exit_code == 0
    assert sorted(line["nodes"][0] for line in lines) == ["gpu-001", "gpu-002"]
    stderr = result.stderr
    assert f"{events}:2: not JSON" in stderr
    assert f"{events}:3: time: Input should have timezone info" in stderr
    assert f"{events}:4: expected a JSON object, got list" in stderr
    assert f"{events}:1:" not in stderr and f"{events}:6:" not in stderr
    assert "ignored 1 repeated event ids" in stderr
    assert all(line.startswith("{") for line in result.stdout.splitlines())  # stdout stays pure JSON


def test_only_malformed_lines_gives_no_output_and_exit_0(tmp_path: Path) -> None:
    lines, result = triage_json(str(write(tmp_path / "junk.jsonl", ["{", "42"])))
    assert lines == []
    assert result.stdout == ""
    assert "junk.jsonl:1:" in result.stderr and "junk.jsonl:2:" in result.stderr


BROKEN_POLICY = textwrap.dedent(
    """\
    version: 1
    rules:
      - id: bus
        description: XID 79
        when: {xids: [79]}
        then: {classification: hardware, action: reboot}
    """
)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (BROKEN_POLICY, ":5:12: rules.0.when.xids: unknown key"),
        ("version: 1\nrules: [\n", ":3:1: invalid YAML"),
    ],
    ids=["unknown-key", "invalid-yaml"],
)
def test_broken_policy_exits_2_with_file_line_column(tmp_path: Path, text: str, where: str) -> None:
    policy = tmp_path / "broken.yaml"
    policy.write_text(text, encoding="utf-8")
    events = write(tmp_path / "events.jsonl", [ev("x-1", "xid", attributes={"code": 79})])
    for option in ("--policy", "-p"):
        result = runner.invoke(app, ["triage", str(events), option, str(policy), "--json"])
        assert result.exit_code == 2, result.output
        assert f"{policy}{where}" in result.stderr
        assert result.stdout == ""


def test_missing_policy_file_exits_2(tmp_path: Path) -> None:
    events = write(tmp_path / "events.jsonl", [ev("x-1", "xid", attributes={"code": 79})])
    result = runner.invoke(app, ["triage", str(events), "--policy", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "nope.yaml" in result.stderr and "cannot read" in result.stderr


def test_policy_option_and_env_choose_the_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = tmp_path / "strict.yaml"
    policy.write_text(BROKEN_POLICY.replace("xids", "xid").replace("reboot", "replace"), encoding="utf-8")
    events = str(write(tmp_path / "events.jsonl", [ev("x-1", "xid", attributes={"code": 79})]))
    lines, _ = triage_json(events, "--policy", str(policy))
    assert (lines[0]["rule"], lines[0]["action"]) == ("bus", "replace")
    monkeypatch.setenv("MEDIC_POLICY", str(policy))
    lines, _ = triage_json(events)
    assert (lines[0]["rule"], lines[0]["action"]) == ("bus", "replace")


def test_table_mode(tmp_path: Path) -> None:
    events = write(
        tmp_path / "events.jsonl",
        [ev(f"x-{i}", "xid", seconds=i, attributes={"code": 79}) for i in range(3)]
        + [ev("n-1", "nan_loss", node="gpu-002")],
    )
    lines, _ = triage_json(str(events))
    result = runner.invoke(app, ["triage", str(events)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Triage with" in out and "default.yaml" in out
    for line in lines:
        assert line["incident"] in out
        assert line["rule"] in out
    assert "reboot" in out and "application-fault" in out
    assert not out.lstrip().startswith("{")


def test_missing_events_file_is_a_usage_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["triage", str(tmp_path / "absent.jsonl"), "--json"])
    assert result.exit_code == 2
    assert result.stdout == ""


def _medic_command() -> list[str]:
    script = Path(sys.executable).with_name("medic")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from medic.apps.cli.app import main; main()"]


def test_console_script_prints_the_same_lines(tmp_path: Path) -> None:
    # A path longer than a terminal line: rich must not fold the `file:line` of a rejection.
    (tmp_path / ("d" * 90)).mkdir()
    events = write(
        tmp_path / ("d" * 90) / "events.jsonl",
        [ev(f"x-{i}", "xid", seconds=i, attributes={"code": 79}) for i in range(5)]
        + ["oops", ev("n-1", "nan_loss", node="gpu-002")],
    )
    expected = runner.invoke(app, ["triage", str(events), "--json"]).stdout
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    done = subprocess.run(
        [*_medic_command(), "triage", str(events), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected
    assert [set(json.loads(line)) for line in done.stdout.splitlines()] == [CONTRACT_KEYS] * 2
    assert f"{events}:6: not JSON" in done.stderr


# What `medic triage` must not load: Prefect, the store and its SQL toolkit, the backends. It holds
# little more than the events in reach of its windows (BENCHMARKS.md, section 2a); those cost ~30 MB.
_NOT_FOR_TRIAGE = (
    "prefect",
    "sqlalchemy",
    "medic.store",
    "medic.tasks.runtime.process",
    "medic.integrations.registry",
)


def test_triage_loads_neither_prefect_nor_the_store(tmp_path: Path) -> None:
    events = write(tmp_path / "events.jsonl", [ev("x-1", "xid", attributes={"code": 79})])
    code = (
        "import sys; from medic.apps.cli.app import main\n"
        "sys.argv = ['medic', 'triage', sys.argv[1], '--json']\n"
        "try:\n    main()\nexcept SystemExit as stop:\n    assert not stop.code, stop.code\n"
        f"print(sorted(m for m in {_NOT_FOR_TRIAGE!r} if m in sys.modules), file=sys.stderr)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(events)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rule"] == "xid-fallen-off-bus"
    assert done.stderr.strip().splitlines()[-1] == "[]"


def test_unreadable_events_file_exits_2_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = write(tmp_path / "events.jsonl", [ev("x-1", "xid", attributes={"code": 79})])

    def denied(path: Path) -> Any:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("medic.apps.cli.triage_parallel.read_file", denied)
    result = runner.invoke(app, ["triage", str(events), "--json"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert f"error: cannot read {events}: Permission denied" in result.stderr


def test_hostile_lines_are_rejected_and_the_rest_triaged(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text(
        "\n".join(
            [
                ev("x-1", "xid", node="gpu-001", attributes={"code": 79}),
                ev("bad-1", "xid", attributes={"code": 79}).replace(
                    '"2025-03-01T12:00:00Z"', '"0001-01-01T00:00:00+01:00"'
                ),
                ev("bad-2", "xid", gpu=2**63, attributes={"code": 79}),
                ev("bad-3", "xid", attributes={"code": 79}).replace('"test"', '"\\ud800"'),
                ev("x-2", "xid", node="gpu-002", attributes={"code": 79}),
            ]
        )
    )
    lines, result = triage_json(str(events))
    assert [line["nodes"] for line in lines] == [["gpu-001"], ["gpu-002"]]
    for number, why in [(2, "time: "), (3, "gpu: integer out of range"), (4, "source: not valid UTF-8")]:
        assert f"rejected {events}:{number}: {why}" in result.stderr


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bar_on_a_terminal_only_and_never_on_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, terminal: bool
) -> None:
    events = write(
        tmp_path / "events.jsonl",
        [ev(f"p-{i}", "nan_loss", node=f"gpu-{i:03d}") for i in range(5)],
    )
    drawn = io.StringIO()
    monkeypatch.setattr("medic.apps.cli.triage.err", Console(file=drawn, force_terminal=terminal, width=200))
    monkeypatch.setattr("medic.apps.cli.triage.PROGRESS_EVERY", 1)
    lines, result = triage_json(str(events))
    assert len(lines) == 5
    assert all(line.startswith("{") for line in result.stdout.splitlines())  # stdout stays pure JSON
    assert "events" not in result.stdout
    assert ("5 events" in drawn.getvalue()) is terminal


# --- node groups (docs/triage.md#node-groups-and-modes) ----------------------------------------


def test_each_incident_is_decided_in_its_nodes_group_and_mode(tmp_path: Path) -> None:
    policy = write_grouped(tmp_path / "grouped.yaml")
    events = write(
        tmp_path / "events.jsonl",
        [
            ev("w-1", "xid", node="gpu-node-1", gpu=0, attributes={"code": 79}),
            ev("f-1", "xid", node="gpu-node-3", gpu=0, minutes=1, attributes={"code": 79}),
            ev("r-1", "xid", node="gpu-node-5", gpu=0, minutes=2, attributes={"code": 79}),
        ],
    )
    lines, _ = triage_json(str(events), "--policy", str(policy))
    by_node = {line["nodes"][0]: line for line in lines}
    assert all(set(line) == CONTRACT_KEYS for line in lines)
    watched, fixed, rack = by_node["gpu-node-1"], by_node["gpu-node-3"], by_node["gpu-node-5"]
    # The observe group's own rule: what would have been done, nothing done.
    assert (watched["group"], watched["mode"], watched["rule"], watched["action"]) == (
        "watch",
        "observe",
        "watch-drain-first",
        "drain",
    )
    assert (fixed["group"], fixed["mode"], fixed["rule"], fixed["action"]) == (
        "fix",
        "remediate",
        "xid-fallen-off-bus",
        "reboot",
    )
    assert watched["group_problem"] is None and fixed["group_problem"] is None
    # gpu-node-5's group turns on its features, which a file of events does not hold: left alone, escalated.
    problem = "cannot tell whether gpu-node-5 is in group racks: the scheduler gives no features for it"
    assert (rack["group"], rack["mode"], rack["action"], rack["group_problem"]) == (
        None,
        "observe",
        "escalate",
        problem,
    )
    assert f"node group undecidable: {problem}; nothing done, handed to people" in rack["reason"]

    # The table, wide enough that no cell folds: nodes, then group (mode), class and action.
    result = runner.invoke(app, ["triage", str(events), "--policy", str(policy)], env={"COLUMNS": "500"})
    assert result.exit_code == 0, result.output
    cells = [[cell.strip() for cell in row.split("│")] for row in result.stdout.splitlines() if "│" in row]
    rows = {row[2]: row[4:7] for row in cells if len(row) > 7}
    assert rows["gpu-node-1"] == ["watch (observe)", "hardware", "would have: drain"]
    assert rows["gpu-node-3"] == ["fix (remediate)", "hardware", "reboot"]
    assert rows["gpu-node-5"] == ["undecidable (observe)", "hardware", "escalate"]
