"""`medic policy explain|test|schema` and `medic breaker` through the CLI."""

from __future__ import annotations

import json
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from checkout import REPO_ROOT
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.store import Store

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"
SCHEMA = REPO_ROOT / "policies" / "policy.schema.json"
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

runner = CliRunner()


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one table row per line


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def write_events(path: Path, *events: dict[str, Any]) -> Path:
    lines = []
    for n, fields in enumerate(events):
        at = T0 + timedelta(minutes=fields.pop("minutes", 0))
        lines.append(json.dumps({"id": f"e{n}", "time": at.isoformat(), "source": "test", **fields}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- policy explain ---------------------------------------------------------------------------

EXPLAINED = """\
    version: 1
    guardrails:
      max_out_of_service: 1
    rules:
      - id: bus-off
        description: XID 79
        when: {xid: [79]}
        then: {classification: hardware, action: drain}
      - id: many-xids
        description: A burst of XIDs
        when: {kinds: [xid], min_events: 3}
        then: {classification: hardware, action: replace}
      - id: dbe
        description: Double-bit errors
        when: {ecc_dbe_at_least: 1}
        then: {classification: hardware, action: reset_gpu}
      - id: storm
        description: XIDs under one switch
        override: true
        when: {switch: {kinds: [xid], nodes_at_least: 2}}
        then: {classification: infrastructure, action: escalate, owner: network}
    """


def rule_rows(output: str) -> dict[str, list[str]]:
    """The rules table: rule id -> [action, matched, because / failed on] (every incident's)."""
    rows: dict[str, list[str]] = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 4 and cells[0] != "rule":
            rows.setdefault(cells[0], []).extend(cells[1:])
    return rows


def test_explain_prints_facts_every_rule_and_the_winner(tmp_path: Path) -> None:
    policy = write(tmp_path / "p.yaml", EXPLAINED)
    events = write_events(
        tmp_path / "events.jsonl",
        {"kind": "xid", "node": "n1", "gpu": 3, "switch": "leaf-1", "attributes": {"code": 79}},
    )
    result = runner.invoke(app, ["policy", "explain", str(policy), str(events)])
    assert result.exit_code == 0, result.output
    facts = [line.split() for line in result.stdout.splitlines()]
    for fact in (
        ["node", "n1"],
        ["switch", "leaf-1"],
        ["events", "1"],
        ["kinds", "xid"],
        ["xid", "79"],
        ["gpus", "3"],
    ):
        assert fact in facts
    assert rule_rows(result.stdout) == {
        "bus-off": ["drain", "yes", "XID 79"],
        "many-xids": ["replace", "no", "`min_events` does not hold"],
        "dbe": ["reset_gpu", "no", "needs events of kind ecc"],
        "storm": ["escalate", "no", "`switch` does not hold"],
    }
    assert "Decision: drain (hardware) by rule bus-off." in result.stdout
    assert "XID 79: XID 79" in result.stdout  # the decision's reason
    assert "Guardrail" not in result.stdout


def test_explain_shows_the_cross_node_rule_and_the_guardrail(tmp_path: Path) -> None:
    policy = write(tmp_path / "p.yaml", EXPLAINED)

    def bus_off(node: str, switch: str, minutes: int) -> dict[str, object]:
        return {
            "kind": "xid",
            "node": node,
            "gpu": 0,
            "switch": switch,
            "attributes": {"code": 79},
            "minutes": minutes,
        }

    events = write_events(
        tmp_path / "events.jsonl",
        bus_off("n1", "leaf-1", 0),
        bus_off("n2", "leaf-3", 30),
        bus_off("n3", "leaf-2", 31),
        bus_off("n4", "leaf-2", 31),
    )
    result = runner.invoke(app, ["policy", "explain", str(policy), str(events), "--fleet-size", "8"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    # n1 is drained and stays out; n2 alone under leaf-3 would be the second node out.
    n2 = out[out.index("on n2") : out.index("on switch leaf-2")]
    assert "Decision: escalate (hardware) by rule bus-off." in n2
    assert "Guardrail max_out_of_service stopped drain." in n2
    # n3 and n4 are a two-node storm under leaf-2: one incident, the override wins, nothing taken out.
    storm = out[out.index("on switch leaf-2 (2 nodes)") :]
    assert rule_rows(storm)["storm"] == ["escalate", "yes", "2 nodes under leaf-2 report xid within 5 min"]
    assert "Decision: escalate (infrastructure) by rule storm, told to network." in storm
    assert "Guardrail" not in storm


def test_explain_shows_dcgm_severity_and_category(tmp_path: Path) -> None:
    events = write_events(
        tmp_path / "events.jsonl",
        {"kind": "dcgm_health", "node": "n1", "gpu": 0, "attributes": {"error_id": "DCGM_FR_NVLINK_DOWN"}},
    )
    result = runner.invoke(app, ["policy", "explain", str(DEFAULT_POLICY), str(events)])
    assert result.exit_code == 0, result.output
    facts = [line.split() for line in result.stdout.splitlines()]
    assert ["dcgm", "health", "DCGM_FR_NVLINK_DOWN"] in facts
    assert ["dcgm", "severity", "TRIAGE"] in facts
    assert ["dcgm", "category", "HARDWARE_NVLINK"] in facts
    assert rule_rows(result.stdout)["dcgm-health-triage"][:2] == ["diagnose", "yes"]


GROUPED = (
    EXPLAINED.rstrip(" ")
    + """\
    groups:
      - {name: canary, select: {hostlist: ["n[1-2]"]}, mode: observe}
      - name: racks
        select: {partitions: [gpu], features: [nvl72]}
        mode: contain
        rules:
          - {id: rack-drain, description: Drain the tray, override: true, when: {xid: [79]},
             then: {classification: hardware, action: drain}}
    """
)


def test_explain_says_which_group_a_node_is_in_and_why(tmp_path: Path) -> None:
    policy = write(tmp_path / "p.yaml", GROUPED)
    result = runner.invoke(
        app, ["policy", "explain", str(policy), "--node", "r7", "--partition", "gpu", "--feature", "nvl72"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        "Group: racks, mode contain: r7 is in group racks (partition gpu; features nvl72)"
    )
    # Without its partitions, r7's group cannot be told: said, not guessed.
    result = runner.invoke(app, ["policy", "explain", str(policy), "--node", "r7", "--feature", "nvl72"])
    assert "Group: undecidable, mode observe: cannot tell whether r7 is in group racks: " in result.stdout
    assert "the scheduler gives no partitions for it" in result.stdout


def test_explain_decides_a_groups_node_with_its_rules_and_mode(tmp_path: Path) -> None:
    policy = write(tmp_path / "p.yaml", GROUPED)
    events = write_events(tmp_path / "e.jsonl", {"kind": "xid", "node": "r7", "attributes": {"code": 79}})
    args = ["policy", "explain", str(policy), str(events), "--node", "r7", "--partition", "gpu"]
    result = runner.invoke(app, [*args, "--feature", "nvl72"])
    assert result.exit_code == 0, result.output
    assert "Group: racks, mode contain" in result.stdout
    assert rule_rows(result.stdout)["rack-drain"] == ["drain", "yes", "XID 79"]
    assert "Decision: drain (hardware) by rule rack-drain." in result.stdout
    observed = write_events(tmp_path / "o.jsonl", {"kind": "xid", "node": "n1", "attributes": {"code": 79}})
    result = runner.invoke(
        app, ["policy", "explain", str(policy), str(observed), "--node", "n1", "--feature", "ib"]
    )
    assert "Group: canary, mode observe" in result.stdout
    assert "Observe mode: GPU Medic would only say it would drain." in result.stdout


def test_check_refuses_overlapping_groups_at_their_line(tmp_path: Path) -> None:
    policy = write(
        tmp_path / "p.yaml",
        GROUPED.replace('hostlist: ["n[1-2]"]', "partitions: [gpu], features: [nvl72, a]"),
    )
    result = runner.invoke(app, ["policy", "check", str(policy)])
    assert result.exit_code == 1
    line = next(n for n, text in enumerate(policy.read_text().splitlines(), 1) if "name: racks" in text)
    assert result.stderr.startswith(f"{policy}:{line + 1}:")
    assert (
        "groups.1.select: group 'racks' overlaps group 'canary' (partition gpu; features a, nvl72)"
        in result.stderr
    )


def test_explain_with_a_broken_policy_exits_2(tmp_path: Path) -> None:
    policy = write(tmp_path / "p.yaml", "version: 1\nrules: []\nfoo: 1\n")
    events = write_events(tmp_path / "events.jsonl", {"kind": "nan_loss", "node": "n1"})
    result = runner.invoke(app, ["policy", "explain", str(policy), str(events)])
    assert result.exit_code == 2
    assert f"{policy}:3:1: foo: unknown key" in result.stderr


# --- policy test ----------------------------------------------------------------------------


def test_the_default_policy_passes_its_own_tests() -> None:
    result = runner.invoke(app, ["policy", "test", str(DEFAULT_POLICY)])
    assert result.exit_code == 0, result.output
    summary = result.stdout.strip().splitlines()[-1]
    passed = int(summary.split()[0])
    assert summary == f"{passed} passed, 0 failed"
    assert passed >= 30
    assert result.stdout.count("PASS ") == passed


CASES = """\
    tests:
      - name: XID 79 reboots
        events: [{kind: xid, node: n1, gpu: 0, attributes: {code: 79}}]
        expect: {action: reboot, rule: xid-fallen-off-bus}
      - name: a wrong expectation
        events: [{kind: xid, node: n1, gpu: 0, attributes: {code: 79}}]
        expect: {action: replace, classification: software, rule: xid-fallen-off-bus}
      - name: the storm's third node
        fleet_size: 8
        events:
          - {kind: xid, node: n1, gpu: 0, minutes_ago: 3, attributes: {code: 79}}
          - {kind: xid, node: n2, gpu: 0, minutes_ago: 2, attributes: {code: 79}}
          - {kind: xid, node: n3, gpu: 0, attributes: {code: 79}}
          - {kind: nan_loss, node: n9, job: j, hours_ago: 1}
        expect: {node: n3, action: escalate, guardrail: circuit_breaker}
    """


def test_a_failing_case_prints_expected_and_got_and_exits_1(tmp_path: Path) -> None:
    cases = write(tmp_path / "cases.yaml", CASES)
    result = runner.invoke(app, ["policy", "test", str(DEFAULT_POLICY), str(cases)])
    assert result.exit_code == 1, result.output
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert lines == [
        "PASS XID 79 reboots (xid-fallen-off-bus)",
        "FAIL a wrong expectation (xid-fallen-off-bus)",
        "- action: expected replace, got reboot",
        "- classification: expected software, got hardware",
        "PASS the storm's third node (xid-fallen-off-bus)",
        "2 passed, 1 failed",
    ]


def test_tests_next_to_the_policy_are_found_by_name(tmp_path: Path) -> None:
    policy = tmp_path / "site.yaml"
    policy.write_bytes(DEFAULT_POLICY.read_bytes())
    write(
        tmp_path / "site.tests.yaml",
        CASES.replace("action: replace, classification: software", "action: reboot"),
    )
    result = runner.invoke(app, ["policy", "test", str(policy)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == "3 passed, 0 failed"


def test_an_unknown_node_in_expect_fails(tmp_path: Path) -> None:
    cases = write(
        tmp_path / "cases.yaml",
        """\
        tests:
          - name: wrong node
            events: [{kind: nan_loss, node: n1}]
            expect: {node: n2, action: none}
        """,
    )
    result = runner.invoke(app, ["policy", "test", str(DEFAULT_POLICY), str(cases)])
    assert result.exit_code == 1
    assert "- no incident on node n2" in result.stdout


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            """\
            tests:
              - name: typo
                events: [{kind: nan_loss, node: n1}]
                expected: {action: none}
            """,
            ":4:5: tests.0.expected: unknown key",  # and, at 2:5, tests.0.expect: Field required
        ),
        (
            """\
            tests:
              - name: bad action
                events: [{kind: nan_loss, node: n1}]
                expect: {action: explode}
            """,
            ":4:22: tests.0.expect.action: expected 'none', 'diagnose',",
        ),
        ("tests: [\n", ":2:1: invalid YAML"),
    ],
)
def test_a_malformed_tests_file_exits_2_with_file_and_line(tmp_path: Path, text: str, problem: str) -> None:
    cases = write(tmp_path / "cases.yaml", text)
    result = runner.invoke(app, ["policy", "test", str(DEFAULT_POLICY), str(cases)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert all(line.startswith(f"{cases}:") for line in lines)
    assert any(line.startswith(f"{cases}{problem}") for line in lines)
    assert "passed" not in result.stdout


def test_an_invalid_event_in_a_case_exits_2_naming_the_test(tmp_path: Path) -> None:
    cases = write(
        tmp_path / "cases.yaml",
        """\
        tests:
          - name: bad xid
            events: [{kind: xid, node: n1, attributes: {code: 0}}]
            expect: {action: none}
        """,
    )
    result = runner.invoke(app, ["policy", "test", str(DEFAULT_POLICY), str(cases)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"{cases}: test 'bad xid', event 1: attributes.code: ")


def test_a_missing_tests_file_exits_2(tmp_path: Path) -> None:
    policy = tmp_path / "lonely.yaml"
    policy.write_bytes(DEFAULT_POLICY.read_bytes())
    result = runner.invoke(app, ["policy", "test", str(policy)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"{tmp_path / 'lonely.tests.yaml'}:0:0: cannot read")


# --- policy schema --------------------------------------------------------------------------


def test_the_committed_schema_is_current() -> None:
    result = runner.invoke(app, ["policy", "schema"])
    assert result.exit_code == 0, result.output
    assert result.stdout == SCHEMA.read_text(encoding="utf-8"), (
        "policies/policy.schema.json is stale: run `medic policy schema -o policies/policy.schema.json`"
    )


def test_schema_output_file(tmp_path: Path) -> None:
    out = tmp_path / "schema.json"
    result = runner.invoke(app, ["policy", "schema", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    schema = json.loads(out.read_text(encoding="utf-8"))
    assert out.read_text(encoding="utf-8") == SCHEMA.read_text(encoding="utf-8")
    assert {"count", "switch", "dcgm_category"} <= set(schema["$defs"]["When"]["properties"])


def test_the_schema_pins_node_groups_and_modes() -> None:
    """The contract decision 0017 adds: a top-level `mode` (default remediate, as before), `groups`, each
    with a name, a selector, a mode and its own limits, approvals and rules."""
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    defs = schema["$defs"]
    assert schema["properties"]["mode"]["default"] == "remediate"
    assert defs["Mode"]["enum"] == ["observe", "contain", "remediate"]
    assert set(defs["Group"]["properties"]) == {
        "name",
        "description",
        "select",
        "mode",
        "guardrails",
        "approvals",
        "rules",
        "readiness",  # decision 0020: the group's own bar in the rollout report
    }
    assert set(defs["Group"]["required"]) == {"name", "select", "mode"}
    assert set(defs["Selector"]["properties"]) == {
        "partitions",
        "hostlist",
        "names",
        "features",
        "gpu_model",
        "gpus",
    }
    assert "circuit_breaker" not in defs["GroupGuardrails"]["properties"]  # the breaker stays the fleet's
    assert "approvers" not in defs["GroupApprovals"]["properties"]  # whom the Slack buttons check


def test_the_default_policy_points_editors_at_the_schema() -> None:
    first = DEFAULT_POLICY.read_text(encoding="utf-8").splitlines()[0]
    assert first == "# yaml-language-server: $schema=./policy.schema.json"


# --- medic breaker ----------------------------------------------------------------------------


def test_breaker_status_and_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'medic.db'}"
    monkeypatch.setenv("MEDIC_DATABASE_URL", url)
    store = Store(url)

    closed = runner.invoke(app, ["breaker", "status"])
    assert closed.exit_code == 0, closed.output
    assert closed.stdout.startswith("closed")

    store.open_breaker("storm", "inc-7")
    opened = runner.invoke(app, ["breaker", "status"])
    assert opened.exit_code == 3
    assert "open since" in opened.stdout
    assert "(incident inc-7)" in opened.stdout
    assert opened.stdout.strip().splitlines()[-1] == "storm"

    result = runner.invoke(app, ["breaker", "close", "--by", "alice"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("closed by alice; opened ")
    assert store.open_breaker_record() is None

    assert runner.invoke(app, ["breaker", "status"]).exit_code == 0
    again = runner.invoke(app, ["breaker", "close", "--by", "bob"])
    assert (again.exit_code, again.stdout.strip()) == (0, "it was not open")
    store.close()


def test_breaker_close_needs_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'medic.db'}"
    monkeypatch.setenv("MEDIC_DATABASE_URL", url)
    store = Store(url)
    store.open_breaker("storm")
    result = runner.invoke(app, ["breaker", "close"])
    assert result.exit_code == 2
    assert store.open_breaker_record() is not None
    store.close()
