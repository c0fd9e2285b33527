"""`medic dcgm explain` on saved `dcgmi diag -j` output, through a Typer app as `medic` mounts it."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import typer
from checkout import REPO_ROOT, TEST_FIXTURES
from typer.testing import CliRunner

from medic.apps.cli.dcgm import dcgm_app

FIXTURES = TEST_FIXTURES / "dcgm"
DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"

app = typer.Typer()
app.add_typer(dcgm_app, name="dcgm")
cli = CliRunner()


@pytest.fixture(autouse=True)
def _default_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setenv("MEDIC_POLICY", str(DEFAULT_POLICY))


def explain_json(*args: str) -> dict[str, Any]:
    result = cli.invoke(app, ["dcgm", "explain", "--json", *args])
    assert result.exit_code == 0, result.output
    [line] = result.stdout.splitlines()
    return json.loads(line)


@pytest.mark.parametrize(
    ("fixture", "verdict", "level", "error_ids", "worst", "action", "rule"),
    [
        ("l1_pass.json", "pass", 1, [], None, "none", "diag-pass"),
        ("l2_pass.json", "pass", 2, [], None, "none", "diag-pass"),
        ("l2_memory_faulty.json", "fail", 2, ["DCGM_FR_FAULTY_MEMORY"], "ISOLATE", "replace", "diag-isolate"),
        (
            "l2_pcie.json",
            "fail",
            2,
            ["DCGM_FR_PCIE_GENERATION", "DCGM_FR_PCI_REPLAY_RATE"],
            "ISOLATE",
            "replace",
            "diag-isolate",
        ),
        (
            "l3_nvlink.json",
            "fail",
            3,
            ["DCGM_FR_NVLINK_ERROR_THRESHOLD"],
            "ISOLATE",
            "replace",
            "diag-isolate",
        ),
        ("l3_thermal.json", "fail", 3, ["DCGM_FR_TEMP_VIOLATION"], "MONITOR", "none", "diag-monitor"),
        ("v3/l2_pass_3.3.json", "pass", 2, [], None, "none", "diag-pass"),
        (
            "v3/l2_memory_faulty_3.2.json",
            "fail",
            2,
            ["DCGM_FR_FAULTY_MEMORY"],
            "ISOLATE",
            "replace",
            "diag-isolate",
        ),
        ("v3/l3_thermal_3.3.json", "fail", 3, ["DCGM_FR_TEMP_VIOLATION"], "MONITOR", "none", "diag-monitor"),
    ],
)
def test_json_verdict_and_default_policy_decision(
    fixture: str,
    verdict: str,
    level: int,
    error_ids: list[str],
    worst: str | None,
    action: str,
    rule: str,
) -> None:
    out = explain_json(str(FIXTURES / fixture))
    assert (out["verdict"], out["level"], out["error_ids"], out["worst_severity"]) == (
        verdict,
        level,
        error_ids,
        worst,
    )
    assert (out["decision"]["action"], out["decision"]["rule"]) == (action, rule)
    assert out["node"] == Path(fixture).stem
    assert out["policy"]["path"] == str(DEFAULT_POLICY)
    assert out["decision"]["policy_sha256"] == out["policy"]["sha256"]


def test_json_lists_every_gpu_with_its_findings() -> None:
    out = explain_json(str(FIXTURES / "l2_memory_faulty.json"))
    assert [(e["group"], e["entity_id"], e["status"]) for e in out["entities"]] == [
        ("GPU", g, "fail" if g == 3 else "pass") for g in range(8)
    ]
    assert out["entities"][3]["findings"] == [
        {
            "test": "memory",
            "error_id": 52,
            "name": "DCGM_FR_FAULTY_MEMORY",
            "severity": "ISOLATE",
            "category": "HARDWARE_MEMORY",
            "message": "Found 2 faulty memory elements on GPU 3",
        }
    ]
    assert (out["dcgm_version"], out["driver_version"]) == ("4.2.3", "550.127.08")


def test_table_names_the_gpu_error_severity_category_and_decision() -> None:
    result = cli.invoke(app, ["dcgm", "explain", str(FIXTURES / "l2_pcie.json")])
    assert result.exit_code == 0, result.output
    rows = {
        line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.startswith("│ GPU")
    }
    assert len(rows) == 8
    for needle in ("fail", "pcie", "DCGM_FR_PCI_REPLAY_RATE (3)", "ISOLATE", "HARDWARE_PCIE"):
        assert needle in rows["GPU 5"]
    for needle in ("DCGM_FR_PCIE_GENERATION (45)", "TRIAGE"):
        assert needle in rows["GPU 2"]
    assert "pass" in rows["GPU 0"] and "DCGM_FR" not in rows["GPU 0"]
    assert "level 2" in result.stdout
    assert "Verdict: FAIL, failed tests: pcie" in result.stdout
    assert "worst DCGM severity ISOLATE" in result.stdout
    assert "replace (hardware) by rule diag-isolate" in result.stdout


def test_runtime_error_is_explained_without_a_decision() -> None:
    out = explain_json(str(FIXTURES / "runtime_error.json"))
    assert (out["verdict"], out["decision"], out["level"], out["entities"]) == ("error", None, None, [])
    assert "killed by a signal" in out["reason"]
    text = cli.invoke(app, ["dcgm", "explain", str(FIXTURES / "runtime_error.json")])
    assert text.exit_code == 0
    assert "Verdict: ERROR" in text.stdout and "no verdict about the GPUs" in text.stdout


@pytest.mark.parametrize("as_json", [[], ["--json"]])
def test_truncated_file_is_a_clear_error(as_json: list[str]) -> None:
    result = cli.invoke(app, ["dcgm", "explain", *as_json, str(FIXTURES / "l2_truncated.json")])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "l2_truncated.json: not usable dcgmi diag output: truncated JSON" in result.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("Error: Unable to connect to host engine.\n", "not JSON"),
        ('{"DCGM Diagnostic": {"test_categories": [{"category": "Hardware"}]}}', "tests: Field required"),
        ("", "empty output"),
    ],
)
def test_malformed_file_exits_2(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "diag.json"
    path.write_text(content)
    result = cli.invoke(app, ["dcgm", "explain", str(path)])
    assert result.exit_code == 2
    assert message in result.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    result = cli.invoke(app, ["dcgm", "explain", str(tmp_path / "absent.json")])
    assert result.exit_code == 2
    assert "absent.json" in result.stderr and "No such file" in result.stderr


def test_policy_option_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    strict = tmp_path / "strict.yaml"
    strict.write_text(
        textwrap.dedent(
            """\
            version: 1
            rules:
              - id: any-diag-failure
                description: Every failed diagnostic goes to people
                when:
                  diagnostic: {result: fail}
                then: {classification: hardware, action: escalate}
            """
        )
    )
    fixture = str(FIXTURES / "l3_thermal.json")
    assert explain_json(fixture, "--policy", str(strict))["decision"]["rule"] == "any-diag-failure"
    monkeypatch.setenv("MEDIC_POLICY", str(strict))
    assert explain_json(fixture)["decision"]["action"] == "escalate"


def test_bad_policy_exits_2(tmp_path: Path) -> None:
    result = cli.invoke(
        app, ["dcgm", "explain", str(FIXTURES / "l1_pass.json"), "--policy", str(tmp_path / "x.yaml")]
    )
    assert result.exit_code == 2
    assert "policy error" in result.stderr and "cannot read" in result.stderr


def test_level_option_overrides_the_tests() -> None:
    out = explain_json(str(FIXTURES / "l2_memory_faulty.json"), "--level", "3")
    assert out["level"] == 3
    assert "DCGM level 3 fail" in out["decision"]["reason"]


def test_standard_input_is_about_node() -> None:
    text = (FIXTURES / "l2_memory_faulty.json").read_text()
    result = cli.invoke(app, ["dcgm", "explain", "--json", "-"], input=text)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["node"], out["decision"]["action"]) == ("node", "replace")


def test_unknown_tests_need_a_level(tmp_path: Path) -> None:
    data = json.loads((FIXTURES / "l1_pass.json").read_text())
    data["DCGM Diagnostic"]["test_categories"][0]["tests"][0]["name"] = "future_test"
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    result = cli.invoke(app, ["dcgm", "explain", str(path)])
    assert result.exit_code == 2
    assert "no test tells the level (future_test); pass --level" in result.stderr
    # At level 1 the output lacks the level-1 test: incomplete, so no decision.
    out = explain_json(str(path), "--level", "1")
    assert (out["verdict"], out["decision"]) == ("incomplete", None)
    assert [(g["test"], g["status"]) for g in out["skipped"]] == [("software", "missing")]
    data["DCGM Diagnostic"]["test_categories"][0]["tests"].insert(0, {"name": "software", **data_software()})
    path.write_text(json.dumps(data))
    assert explain_json(str(path))["decision"]["rule"] == "diag-pass"


def data_software() -> dict[str, Any]:
    software = json.loads((FIXTURES / "l1_pass.json").read_text())["DCGM Diagnostic"]["test_categories"][0]
    return {k: v for k, v in software["tests"][0].items() if k != "name"}


def test_node_named_after_a_long_file_is_cut_to_a_valid_node(tmp_path: Path) -> None:
    path = tmp_path / ("gpu-node-" + "7" * 230 + ".json")
    path.write_text((FIXTURES / "l2_memory_faulty.json").read_text())
    out = explain_json(str(path))
    assert out["node"] == path.stem[:200]
    assert out["decision"]["rule"] == "diag-isolate"


@pytest.mark.parametrize("fixture", ["l2_skipped.json", "v3/l2_skipped_3.3.json"])
def test_skipped_tests_are_incomplete_with_no_decision(fixture: str) -> None:
    out = explain_json(str(FIXTURES / fixture))
    assert (out["verdict"], out["level"], out["decision"]) == ("incomplete", 2, None)
    assert out["reason"].startswith("not every test of the level ran: ")
    assert [(g["level"], g["status"], g["where"]) for g in out["skipped"]] == [(2, "skipped", [])] * 2


def test_json_lists_each_skipped_test_with_its_reason() -> None:
    out = explain_json(str(FIXTURES / "l2_skipped.json"))
    memory, pcie = out["skipped"]
    assert (memory["test"], memory["where"]) == ("memory", [])
    assert "Skipping test Memory because ECC is not enabled on GPU 7" in memory["reason"]
    assert pcie == {
        "test": "pcie",
        "level": 2,
        "status": "skipped",
        "where": [],
        "reason": "The pcie test is skipped.",
        "required": True,
    }


def test_table_lists_skipped_tests_and_why() -> None:
    result = cli.invoke(app, ["dcgm", "explain", str(FIXTURES / "l2_skipped.json")])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Skipped or not run" in out
    assert "The pcie test is skipped." in out
    assert "Skipping test Memory because ECC is not enabled on GPU 0" in out
    assert "Verdict: INCOMPLETE" in out
    assert "Decision: none; the run left tests out" in out


def test_table_of_a_dcgm_3_skip_says_no_reason_was_given() -> None:
    result = cli.invoke(app, ["dcgm", "explain", str(FIXTURES / "v3" / "l2_skipped_3.3.json")])
    assert result.exit_code == 0, result.output
    assert "GPU Memory" in result.stdout and "no reason given in the output" in result.stdout


def test_a_pass_read_at_a_higher_level_is_incomplete() -> None:
    out = explain_json(str(FIXTURES / "l2_pass.json"), "--level", "3")
    assert (out["verdict"], out["decision"]) == ("incomplete", None)
    assert [g["test"] for g in out["skipped"]] == [
        "diagnostic",
        "targeted_stress",
        "targeted_power",
        "memory_bandwidth",
    ]
    assert all(g["status"] == "missing" for g in out["skipped"])


def test_a_pass_has_an_empty_skipped_list() -> None:
    assert explain_json(str(FIXTURES / "l2_pass.json"))["skipped"] == []
