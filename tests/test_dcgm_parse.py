"""Reading `dcgmi diag -j` output: the fixtures against NVIDIA's schema, verdicts, severities."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from integrations.dcgm.parse import DcgmOutputError, Status, Verdict, parse_report
from medic.dcgm_errors import Severity

FIXTURES = Path(__file__).parent / "fixtures" / "dcgm"
# NVIDIA's schema names no draft ("http://json-schema.org/schema#", i.e. the latest).
SCHEMA = jsonschema.Draft202012Validator(json.loads((FIXTURES / "dcgm_diag_schema.json").read_text()))
SAVED_OUTPUTS = sorted(
    p.name for p in FIXTURES.glob("*.json") if p.name not in ("dcgm_diag_schema.json", "l2_truncated.json")
)


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def report_of(data: dict[str, Any]):  # type: ignore[no-untyped-def]
    return parse_report(json.dumps(data))


def gpu_result(gpu: int, status: str, warnings: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"entity_group": "GPU", "entity_group_id": 1, "entity_id": gpu, "status": status}
    if warnings:
        result["warnings"] = warnings
    return result


def one_test(results: list[dict[str, Any]], summary: dict[str, Any], name: str = "memory") -> dict[str, Any]:
    return {
        "DCGM Diagnostic": {
            "test_categories": [
                {
                    "category": "Hardware",
                    "tests": [{"name": name, "results": results, "test_summary": summary}],
                }
            ]
        }
    }


def warning(error_id: int, text: str, severity: int = 2, category: int = 10) -> dict[str, Any]:
    return {"error_category": category, "error_id": error_id, "error_severity": severity, "warning": text}


@pytest.mark.parametrize("name", SAVED_OUTPUTS)
def test_fixture_validates_against_nvidias_schema(name: str) -> None:
    SCHEMA.validate(load(name))


def test_the_fixtures_cover_every_case() -> None:
    assert SAVED_OUTPUTS == [
        "l1_pass.json",
        "l2_memory_faulty.json",
        "l2_pass.json",
        "l2_pcie.json",
        "l3_nvlink.json",
        "l3_thermal.json",
        "runtime_error.json",
    ]


@pytest.mark.parametrize(
    ("name", "verdict", "level", "error_ids", "worst"),
    [
        ("l1_pass.json", Verdict.PASS, 1, (), None),
        ("l2_pass.json", Verdict.PASS, 2, (), None),
        ("l2_memory_faulty.json", Verdict.FAIL, 2, ("DCGM_FR_FAULTY_MEMORY",), Severity.ISOLATE),
        (
            "l2_pcie.json",
            Verdict.FAIL,
            2,
            ("DCGM_FR_PCIE_GENERATION", "DCGM_FR_PCI_REPLAY_RATE"),
            Severity.ISOLATE,
        ),
        ("l3_nvlink.json", Verdict.FAIL, 3, ("DCGM_FR_NVLINK_ERROR_THRESHOLD",), Severity.ISOLATE),
        ("l3_thermal.json", Verdict.FAIL, 3, ("DCGM_FR_TEMP_VIOLATION",), Severity.MONITOR),
        ("runtime_error.json", Verdict.ERROR, None, (), None),
    ],
)
def test_verdict_of_each_fixture(
    name: str, verdict: Verdict, level: int | None, error_ids: tuple[str, ...], worst: Severity | None
) -> None:
    report = parse_report((FIXTURES / name).read_text())
    assert report.verdict is verdict
    assert report.level == level
    assert report.error_ids == error_ids
    assert report.worst_severity is worst


def test_level_two_pass_covers_eight_gpus_in_three_tests() -> None:
    report = parse_report((FIXTURES / "l2_pass.json").read_text())
    assert [(t.name, t.category) for t in report.tests] == [
        ("software", "Deployment"),
        ("memory", "Hardware"),
        ("pcie", "Integration"),
    ]
    entities = report.entities()
    assert [(e.group, e.entity_id, e.status) for e in entities] == [("GPU", g, Status.PASS) for g in range(8)]
    assert (report.dcgm_version, report.driver_version) == ("4.2.3", "550.127.08")


def test_memory_failure_is_on_one_gpu_with_dcgms_severity_and_category() -> None:
    report = parse_report((FIXTURES / "l2_memory_faulty.json").read_text())
    by_gpu = {e.entity_id: e for e in report.entities()}
    assert {g for g, e in by_gpu.items() if e.status is Status.FAIL} == {3}
    [finding] = by_gpu[3].findings
    assert (finding.test, finding.error_id, finding.name) == ("memory", 52, "DCGM_FR_FAULTY_MEMORY")
    assert (finding.severity, finding.category) == (Severity.ISOLATE, "HARDWARE_MEMORY")
    assert finding.message == "Found 2 faulty memory elements on GPU 3"
    assert report.reason == "failed tests: memory"


def test_pcie_failures_keep_each_gpus_own_severity() -> None:
    report = parse_report((FIXTURES / "l2_pcie.json").read_text())
    findings = {e.entity_id: e.findings for e in report.entities() if e.findings}
    assert {g: [(f.name, f.severity) for f in fs] for g, fs in findings.items()} == {
        2: [("DCGM_FR_PCIE_GENERATION", Severity.TRIAGE)],
        5: [("DCGM_FR_PCI_REPLAY_RATE", Severity.ISOLATE)],
    }
    assert {f.category for fs in findings.values() for f in fs} == {"HARDWARE_PCIE"}


def test_runtime_error_is_no_verdict() -> None:
    report = parse_report((FIXTURES / "runtime_error.json").read_text())
    assert report.verdict is Verdict.ERROR
    assert "The NVVS process was killed by a signal" in report.reason
    assert report.tests == () and report.dcgm_version == "4.2.3"


def test_truncated_fixture_is_not_json_and_is_reported_as_truncated() -> None:
    text = (FIXTURES / "l2_truncated.json").read_text()
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(DcgmOutputError, match="truncated JSON"):
        parse_report(text)


@pytest.mark.parametrize("cut", [1, 200, 4000, -3])
def test_output_cut_anywhere_is_truncated(cut: int) -> None:
    text = (FIXTURES / "l2_pass.json").read_text().rstrip()
    with pytest.raises(DcgmOutputError, match="truncated JSON"):
        parse_report(text[:cut])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty output"),
        ("Segmentation fault (core dumped)\n", "not JSON"),
        ('{"DCGM Diagnostic": {}} trailing', "not JSON"),
        ("[" * 100_000, "nested too deeply"),
        ("[]", "partial or unexpected output"),
        ('{"entity_groups": []}', "DCGM Diagnostic: Field required"),
    ],
)
def test_text_that_is_not_dcgmi_output(text: str, message: str) -> None:
    with pytest.raises(DcgmOutputError, match=message):
        parse_report(text)


def _drop(path: tuple[str | int, ...]):  # type: ignore[no-untyped-def]
    def mutate(data: dict[str, Any]) -> None:
        *parents, last = path
        node: Any = data
        for key in parents:
            node = node[key]
        del node[last]

    return mutate


def _set(path: tuple[str | int, ...], value: Any):  # type: ignore[no-untyped-def]
    def mutate(data: dict[str, Any]) -> None:
        *parents, last = path
        node: Any = data
        for key in parents:
            node = node[key]
        node[last] = value

    return mutate


TEST = ("DCGM Diagnostic", "test_categories", 1, "tests", 0)


@pytest.mark.parametrize(
    "mutate",
    [
        _drop((*TEST, "test_summary")),
        _drop((*TEST, "results")),
        _drop((*TEST, "name")),
        _drop((*TEST, "results", 3, "status")),
        _drop((*TEST, "results", 3, "warnings", 0, "error_id")),
        _drop((*TEST, "test_summary", "status")),
        _drop(("DCGM Diagnostic", "test_categories", 1, "category")),
        _drop(("metadata", "version")),
        _drop(("entity_groups", 0, "entities", 0, "device_id")),
        _set((*TEST, "results", 3, "entity_id"), "3"),
        _set((*TEST, "results", 3, "warnings", 0, "error_id"), "52"),
        _set(("DCGM Diagnostic", "test_categories"), {}),
    ],
    ids=[
        "no test_summary",
        "no results",
        "no test name",
        "no status",
        "no error_id",
        "no summary status",
        "no category",
        "no version",
        "no device_id",
        "entity id as text",
        "error id as text",
        "categories not a list",
    ],
)
def test_output_the_schema_rejects_is_partial(mutate) -> None:  # type: ignore[no-untyped-def]
    data = copy.deepcopy(load("l2_memory_faulty.json"))
    mutate(data)
    with pytest.raises(jsonschema.ValidationError):
        SCHEMA.validate(data)
    with pytest.raises(DcgmOutputError, match="partial or unexpected output"):
        report_of(data)


def test_unknown_status_is_rejected_rather_than_guessed() -> None:
    data = one_test([gpu_result(0, "Borked")], {"status": "Pass"})
    SCHEMA.validate(data)
    with pytest.raises(DcgmOutputError, match="unknown status 'Borked'"):
        report_of(data)


def test_error_id_missing_from_the_table_is_unknown_severity() -> None:
    warn = warning(999, "Something new in a later DCGM")
    report = report_of(one_test([gpu_result(0, "Fail", [warn])], {"status": "Fail", "warnings": [warn]}))
    assert report.verdict is Verdict.FAIL
    assert report.error_ids == ("999",)
    assert report.worst_severity is Severity.UNKNOWN


def test_warn_is_a_finding_but_not_a_failure() -> None:
    warn = warning(5, "Detected 12 volatile single-bit ECC errors on GPU 1", severity=1)
    report = report_of(one_test([gpu_result(0, "Pass"), gpu_result(1, "Warn", [warn])], {"status": "Warn"}))
    assert report.verdict is Verdict.PASS
    assert report.error_ids == ()
    gpu1 = report.entities()[1]
    assert gpu1.status is Status.WARN
    assert [f.name for f in gpu1.findings] == ["DCGM_FR_VOLATILE_SBE_DETECTED"]


def test_error_not_tied_to_a_gpu_counts_through_the_test_summary() -> None:
    # dcgmi lists errors of no entity (e.g. the whole node) only in the test summary.
    warn = warning(14, "NVLink link 3 is down", severity=4, category=11)
    report = report_of(one_test([gpu_result(0, "Pass")], {"status": "Fail", "warnings": [warn]}, name="pcie"))
    assert report.verdict is Verdict.FAIL
    assert report.error_ids == ("DCGM_FR_NVLINK_DOWN",)
    assert report.worst_severity is Severity.TRIAGE


def test_failure_with_no_error_ids() -> None:
    report = report_of(one_test([gpu_result(0, "Fail")], {"status": "Fail"}))
    assert (report.verdict, report.error_ids, report.worst_severity) == (Verdict.FAIL, (), None)


def test_a_failing_error_reported_twice_counts_once() -> None:
    warn = warning(52, "Found 2 faulty memory elements on GPU 0")
    report = report_of(one_test([gpu_result(0, "Fail", [warn])], {"status": "Fail", "warnings": [warn]}))
    assert len(report.failing) == 1


def test_everything_skipped_is_no_verdict() -> None:
    report = report_of(one_test([gpu_result(0, "Skip"), gpu_result(1, "Skip")], {"status": "Skip"}))
    assert (report.verdict, report.reason) == (Verdict.ERROR, "every test was skipped")


def test_no_tests_is_no_verdict() -> None:
    report = report_of({"DCGM Diagnostic": {"test_categories": []}})
    assert (report.verdict, report.reason) == (Verdict.ERROR, "no test results in the output")


def test_level_comes_from_the_highest_test_and_ignores_unknown_names() -> None:
    data = load("l3_thermal.json")
    assert report_of(data).level == 3
    data["DCGM Diagnostic"]["test_categories"] = data["DCGM Diagnostic"]["test_categories"][:1]
    assert report_of(data).level == 1
    assert report_of(one_test([gpu_result(0, "Pass")], {"status": "Pass"}, name="future_test")).level is None
