"""Reading `dcgmi diag -j` output (DCGM 3 and 4): the fixtures against NVIDIA's schemas, verdicts,
incomplete runs, severities, and medic's error table against NVIDIA's."""

from __future__ import annotations

import copy
import csv
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from checkout import REPO_ROOT, TEST_FIXTURES

from medic import dcgm_errors
from medic.dcgm_errors import Severity
from medic.integrations.dcgm.parse import NO_REASON, DcgmOutputError, Gap, Status, Verdict, parse_report

FIXTURES = TEST_FIXTURES / "dcgm"
V3 = FIXTURES / "v3"
NVIDIA = FIXTURES / "nvidia"
# NVIDIA's schema names no draft ("http://json-schema.org/schema#", i.e. the latest).
SCHEMA = jsonschema.Draft202012Validator(json.loads((FIXTURES / "dcgm_diag_schema.json").read_text()))
SAVED_OUTPUTS = sorted(
    p.name for p in FIXTURES.glob("*.json") if p.name not in ("dcgm_diag_schema.json", "l2_truncated.json")
)
# NVIDIA's schema for DCGM 3.3 output (draft-04); DCGM 3.0-3.2 output had none.
SCHEMA_3 = jsonschema.Draft4Validator(json.loads((V3 / "dcgm_diag_schema.json").read_text()))
SAVED_OUTPUTS_3 = sorted(p.name for p in V3.glob("*.json") if p.name != "dcgm_diag_schema.json")


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def report_of(data: dict[str, Any]):  # type: ignore[no-untyped-def]
    return parse_report(json.dumps(data))


def gpu_result(gpu: int, status: str, warnings: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"entity_group": "GPU", "entity_group_id": 1, "entity_id": gpu, "status": status}
    if warnings:
        result["warnings"] = warnings
    return result


def one_test(
    results: list[dict[str, Any]], summary: dict[str, Any], name: str = "software"
) -> dict[str, Any]:
    """DCGM 4 output of one test (by default the level-1 one, so that it is a whole run)."""
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
        "l2_skipped.json",
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
        ("l2_skipped.json", Verdict.INCOMPLETE, 2, (), None),
        ("v3/l2_pass_3.3.json", Verdict.PASS, 2, (), None),
        ("v3/l2_skipped_3.3.json", Verdict.INCOMPLETE, 2, (), None),
        ("v3/l3_thermal_3.3.json", Verdict.FAIL, 3, ("DCGM_FR_TEMP_VIOLATION",), Severity.MONITOR),
        ("v3/l2_memory_faulty_3.2.json", Verdict.FAIL, 2, ("DCGM_FR_FAULTY_MEMORY",), Severity.ISOLATE),
        ("v3/runtime_error_3.3.json", Verdict.ERROR, None, (), None),
    ],
)
def test_verdict_of_each_fixture(
    name: str, verdict: Verdict, level: int | None, error_ids: tuple[str, ...], worst: Severity | None
) -> None:
    report = parse_report((FIXTURES / name).read_text())
    assert report.verdict is verdict, report.reason
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
        ("[]", "partial or unexpected output: a JSON list, not an object"),
        (
            '{"entity_groups": []}',
            "no 'DCGM Diagnostic' \\(DCGM 4\\) or 'DCGM GPU Diagnostic' \\(DCGM 3\\) object",
        ),
        ('{"DCGM Diagnostic": {}, "DCGM GPU Diagnostic": {}}', "both 'DCGM Diagnostic'"),
        ('{"DCGM Diagnostic": {}, "metadata": {"version": "3.3.9"}}', "DCGM 3.3.9 in the DCGM 4 layout"),
        ('{"DCGM GPU Diagnostic": {}, "version": "4.1.1"}', "DCGM 4.1.1 in the DCGM 3 layout"),
        ('{"DCGM Diagnostic": {}, "metadata": {"version": "5.0.1"}}', "unsupported DCGM 5.0.1"),
        ('{"DCGM GPU Diagnostic": {"test_categories": {}}}', "partial or unexpected output"),
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


def test_error_id_missing_from_the_table_takes_the_severity_and_category_the_output_states() -> None:
    warn = warning(999, "Something new in a later DCGM", severity=6, category=15)
    report = report_of(one_test([gpu_result(0, "Fail", [warn])], {"status": "Fail", "warnings": [warn]}))
    assert report.verdict is Verdict.FAIL
    assert report.error_ids == ("999",)
    [finding] = report.failing
    assert (finding.name, finding.severity, finding.category) == ("999", Severity.RESET, "HARDWARE_OTHER")
    assert report.worst_severity is Severity.RESET


@pytest.mark.parametrize(("severity", "category"), [(0, 99), (7, -1), (-3, 17)])
def test_an_unknown_id_with_numbers_dcgm_does_not_define_is_unknown(severity: int, category: int) -> None:
    warn = warning(999, "Something new", severity=severity, category=category)
    report = report_of(one_test([gpu_result(0, "Fail", [warn])], {"status": "Fail"}))
    [finding] = report.failing
    assert (finding.severity, finding.category) == (Severity.UNKNOWN, "UNKNOWN")


def test_a_known_id_keeps_the_tables_severity_whatever_the_output_states() -> None:
    # DCGM 4.0 and 3.x printed DCGM_FR_ROW_REMAP_FAILURE as ISOLATE; DCGM 4.6 says RESET.
    warn = warning(80, "GPU 0 had uncorrectable memory errors and row remapping failed.", severity=2)
    report = report_of(one_test([gpu_result(0, "Fail", [warn])], {"status": "Fail"}))
    [finding] = report.failing
    assert (finding.name, finding.severity) == ("DCGM_FR_ROW_REMAP_FAILURE", Severity.RESET)


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


# --- DCGM 3 output --------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in SAVED_OUTPUTS_3 if "_3.3" in n])
def test_dcgm_3_3_fixture_validates_against_nvidias_3_3_schema(name: str) -> None:
    data = json.loads((V3 / name).read_text())
    if "runtime_error" not in data["DCGM GPU Diagnostic"]:  # the schema covers results only
        SCHEMA_3.validate(data)


def test_dcgm_3_fixtures_cover_every_case() -> None:
    assert SAVED_OUTPUTS_3 == [
        "l2_memory_faulty_3.2.json",
        "l2_pass_3.3.json",
        "l2_skipped_3.3.json",
        "l3_thermal_3.3.json",
        "runtime_error_3.3.json",
    ]


def test_dcgm_3_3_pass_reads_versions_tests_and_gpus() -> None:
    report = parse_report((V3 / "l2_pass_3.3.json").read_text())
    assert (report.dcgm_major, report.dcgm_version, report.driver_version) == (3, "3.3.9", "535.183.01")
    assert [t.name for t in report.tests][-2:] == ["PCIe", "GPU Memory"]
    assert {t.category for t in report.tests} == {"Deployment", "Integration", "Hardware"}
    assert [(e.group, e.entity_id, e.status) for e in report.entities()] == [
        ("GPU", 0, Status.PASS),
        ("GPU", 1, Status.PASS),
    ]
    assert report.gaps(2) == ()


def test_dcgm_3_3_failure_has_the_gpu_and_dcgms_severity() -> None:
    report = parse_report((V3 / "l3_thermal_3.3.json").read_text())
    by_gpu = {e.entity_id: e for e in report.entities()}
    assert (by_gpu[0].status, by_gpu[1].status) == (Status.FAIL, Status.PASS)
    [finding] = by_gpu[0].findings
    assert (finding.test, finding.error_id, finding.name) == ("Targeted Power", 42, "DCGM_FR_TEMP_VIOLATION")
    assert (finding.severity, finding.category) == (Severity.MONITOR, "HARDWARE_THERMAL")


def test_dcgm_3_2_warning_text_with_its_error_id_beside_it() -> None:
    report = parse_report((V3 / "l2_memory_faulty_3.2.json").read_text())
    assert report.dcgm_version == "3.2.6"
    by_gpu = {e.entity_id: e for e in report.entities()}
    [finding] = by_gpu[1].findings
    assert (finding.name, finding.severity, finding.message) == (
        "DCGM_FR_FAULTY_MEMORY",
        Severity.ISOLATE,
        "Found 2 faulty memory elements on GPU 1",
    )
    assert report.reason == "failed tests: GPU Memory"


def test_dcgm_3_0_warning_without_an_id_fails_without_an_error_id() -> None:
    data = json.loads((V3 / "l2_memory_faulty_3.2.json").read_text())
    del data["DCGM GPU Diagnostic"]["test_categories"][2]["tests"][0]["results"][1]["error_id"]
    del data["version"]  # DCGM 3.0 printed no version
    report = report_of(data)
    assert (report.verdict, report.error_ids, report.dcgm_version) == (Verdict.FAIL, (), None)
    [finding] = report.failing
    assert (finding.error_id, finding.message) == (None, "Found 2 faulty memory elements on GPU 1")


def test_dcgm_3_3_deployment_failure_tied_to_a_gpu() -> None:
    # DCGM 3.3 puts a deployment test's message under "warnings" and its GPU as a number.
    data = json.loads((V3 / "l2_pass_3.3.json").read_text())
    persistence = data["DCGM GPU Diagnostic"]["test_categories"][0]["tests"][4]
    assert persistence["name"] == "Persistence Mode"
    persistence["results"] = [
        {
            "gpu_id": 1,
            "status": "Fail",
            "warnings": [
                {
                    "error_category": 8,
                    "error_id": 29,
                    "error_severity": 5,
                    "warnings": "Persistence mode for GPU 1 is disabled.",
                }
            ],
        }
    ]
    report = report_of(data)
    assert (report.verdict, report.error_ids) == (Verdict.FAIL, ("DCGM_FR_PERSISTENCE_MODE",))
    assert [f.message for f in report.entities()[1].findings] == ["Persistence mode for GPU 1 is disabled."]
    assert report.worst_severity is Severity.CONFIG


def test_dcgm_3_node_level_deployment_failure_counts_for_the_test() -> None:
    data = json.loads((V3 / "l2_pass_3.3.json").read_text())
    data["DCGM GPU Diagnostic"]["test_categories"][0]["tests"][0]["results"] = [
        {
            "status": "Fail",
            "warnings": [{"error_id": 23, "warnings": "Found driver on the denylist: nouveau"}],
        }
    ]
    report = report_of(data)
    assert (report.verdict, report.error_ids) == (Verdict.FAIL, ("DCGM_FR_DENYLISTED_DRIVER",))


def test_dcgm_3_unknown_id_takes_the_severity_the_output_states() -> None:
    data = json.loads((V3 / "l3_thermal_3.3.json").read_text())
    warn = data["DCGM GPU Diagnostic"]["test_categories"][3]["tests"][1]["results"][0]["warnings"][0]
    warn.update(error_id=500, error_severity=2, error_category=10)
    [finding] = report_of(data).failing
    assert (finding.name, finding.severity, finding.category) == ("500", Severity.ISOLATE, "HARDWARE_MEMORY")


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ({"gpu_id": "zero", "status": "Pass"}, "GPU id 'zero' is not a GPU index"),
        ({"gpu_id": "0"}, "partial or unexpected output"),
        ({"gpu_id": "0", "status": "Borked"}, "unknown status 'Borked'"),
        ({"gpu_id": "0", "status": "Fail", "warnings": [{"warning": "no id"}]}, "error_id: Field required"),
        ({"gpu_id": "0", "status": "Fail", "warnings": [{"error_id": "52"}]}, "partial or unexpected output"),
    ],
)
def test_dcgm_3_results_that_are_not_what_dcgmi_prints(result: dict[str, Any], message: str) -> None:
    data = json.loads((V3 / "l2_pass_3.3.json").read_text())
    data["DCGM GPU Diagnostic"]["test_categories"][1]["tests"][0]["results"] = [result]
    with pytest.raises(DcgmOutputError, match=message):
        report_of(data)


def test_dcgm_3_test_without_results_is_partial() -> None:
    data = json.loads((V3 / "l2_pass_3.3.json").read_text())
    data["DCGM GPU Diagnostic"]["test_categories"][1]["tests"][0]["results"] = []
    with pytest.raises(DcgmOutputError, match="test PCIe has no results"):
        report_of(data)


# --- Incomplete runs: a test of the level skipped, not run, or missing ------------------------


def _l2(mutate: Any = None) -> dict[str, Any]:
    data = load("l2_pass.json")
    if mutate:
        mutate({t["name"]: t for c in data["DCGM Diagnostic"]["test_categories"] for t in c["tests"]})
    return data


def test_level_2_with_memory_and_pcie_skipped_is_incomplete_not_a_pass() -> None:
    report = parse_report((FIXTURES / "l2_skipped.json").read_text())
    assert report.verdict is Verdict.INCOMPLETE
    memory, pcie = report.gaps(2)
    assert (memory.test, memory.level, memory.status, memory.where) == ("memory", 2, "skipped", ())
    assert memory.reason.startswith("Skipping test Memory because ECC is not enabled on GPU 0; ")
    assert pcie == Gap("pcie", 2, "skipped", (), "The pcie test is skipped.")
    assert report.reason.startswith("not every test of the level ran: memory skipped (Skipping test Memory")
    assert "pcie skipped (The pcie test is skipped.)" in report.reason


def test_dcgm_3_level_2_with_its_tests_skipped_is_incomplete() -> None:
    report = parse_report((V3 / "l2_skipped_3.3.json").read_text())
    assert report.verdict is Verdict.INCOMPLETE
    assert report.gaps(2) == (
        Gap("PCIe", 2, "skipped", (), NO_REASON),
        Gap("GPU Memory", 2, "skipped", (), NO_REASON),
    )


def test_one_gpu_skipped_is_incomplete_and_names_the_gpu() -> None:
    def skip_gpu_3(tests: dict[str, Any]) -> None:
        tests["memory"]["results"][3].update(
            status="Skip", info=["Skipping test Memory because ECC is not enabled on GPU 3"]
        )

    report = report_of(_l2(skip_gpu_3))
    assert report.verdict is Verdict.INCOMPLETE
    assert report.gaps(2) == (
        Gap("memory", 2, "skipped", ("GPU 3",), "Skipping test Memory because ECC is not enabled on GPU 3"),
    )
    assert "memory skipped on GPU 3 (Skipping test Memory" in report.reason


def test_a_lower_level_test_skipped_makes_a_higher_level_run_incomplete() -> None:
    def skip_software(tests: dict[str, Any]) -> None:
        tests["software"]["test_summary"]["status"] = "Skip"
        for result in tests["software"]["results"]:
            result["status"] = "Skip"

    assert report_of(_l2(skip_software)).gaps(2)[0].test == "software"


def test_a_test_dcgmi_printed_without_results_or_summary_did_not_run() -> None:
    def not_run(tests: dict[str, Any]) -> None:
        del tests["pcie"]["results"], tests["pcie"]["test_summary"]

    report = report_of(_l2(not_run))
    assert report.verdict is Verdict.INCOMPLETE
    assert report.tests[-1].status is Status.NOT_RUN
    assert report.gaps(2) == (Gap("pcie", 2, "not run", (), NO_REASON),)


def test_a_test_the_level_requires_that_is_missing_is_incomplete_at_that_level() -> None:
    data = load("l2_pass.json")
    data["DCGM Diagnostic"]["test_categories"] = data["DCGM Diagnostic"]["test_categories"][:2]  # no pcie
    report = report_of(data)
    assert report.verdict is Verdict.INCOMPLETE
    [gap] = report.gaps(2)
    assert (gap.test, gap.status) == ("pcie", "missing")
    # The same output read for a level-3 run also lacks the level-3 tests.
    assert [g.test for g in report.gaps(3)] == [
        "pcie",
        "diagnostic",
        "targeted_stress",
        "targeted_power",
        "memory_bandwidth",
    ]
    assert report.judge(3)[0] is Verdict.INCOMPLETE


def test_a_failure_is_a_fail_even_when_another_test_was_skipped() -> None:
    data = load("l2_memory_faulty.json")
    pcie = data["DCGM Diagnostic"]["test_categories"][2]["tests"][0]
    pcie["test_summary"]["status"] = "Skip"
    report = report_of(data)
    assert (report.verdict, report.error_ids) == (Verdict.FAIL, ("DCGM_FR_FAULTY_MEMORY",))
    assert [g.test for g in report.gaps(2)] == ["pcie"]


def test_an_optional_test_skipped_is_listed_but_the_level_passes_on_its_core_tests() -> None:
    data = load("l2_pass.json")
    categories = data["DCGM Diagnostic"]["test_categories"]
    pcie = categories[-1]["tests"][0]
    core_3 = ("diagnostic", "targeted_stress", "targeted_power", "memory_bandwidth")
    stress = [copy.deepcopy(pcie) | {"name": name} for name in core_3]
    nccl = copy.deepcopy(pcie) | {"name": "nccl_tests"}
    nccl["test_summary"] = {"status": "Skip", "info": ["nccl_tests is not allowed on this system"]}
    for result in nccl["results"]:
        result["status"] = "Skip"
    categories.append({"category": "Stress", "tests": [*stress, nccl]})
    report = report_of(data)
    assert report.judge(3)[0] is Verdict.PASS
    [gap] = report.gaps(3)
    assert (gap.test, gap.status, gap.required) == ("nccl_tests", "skipped", False)
    assert gap.describe().endswith("; optional, the level does not need it)")
    # The same run with a core test skipped is incomplete at that level.
    stress[0]["test_summary"] = {"status": "Skip"}
    assert report_of(data).judge(3)[0] is Verdict.INCOMPLETE


def test_with_no_known_level_only_skips_count() -> None:
    report = report_of(one_test([gpu_result(0, "Pass"), gpu_result(1, "Skip")], {"status": "Pass"}, name="x"))
    assert report.level is None
    assert report.verdict is Verdict.INCOMPLETE
    assert report.gaps(None) == (Gap("x", None, "skipped", ("GPU 1",), NO_REASON),)


def test_every_test_not_run_is_no_verdict() -> None:
    data = {"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [{"name": "memory"}]}]}}
    assert report_of(data).verdict is Verdict.ERROR


@pytest.mark.parametrize("missing", ["results", "test_summary"])
def test_a_test_with_only_one_of_results_and_summary_is_partial(missing: str) -> None:
    data = load("l2_pass.json")
    del data["DCGM Diagnostic"]["test_categories"][1]["tests"][0][missing]
    with pytest.raises(DcgmOutputError, match=f"partial or unexpected output: test memory: {missing}"):
        report_of(data)


# --- medic's error table against NVIDIA's ---------------------------------------------------


def _nvidia_table(header: Path, table: Path) -> dict[int, tuple[str, str, str]]:
    """{id: (DCGM_FR_* name, severity, category)} from dcgm_errors.h and dcgm_errors.c's dcgmErrorMeta."""
    h = header.read_text()
    enum = re.search(r"typedef enum dcgmError_enum\s*\{(.*?)\}\s*dcgmError_t;", h, re.S)
    assert enum
    ids = {
        name: int(value)
        for name, value in re.findall(r"^\s*(DCGM_FR_\w+)\s*=\s*(\d+)\s*,", enum.group(1), re.M)
    }
    rows = re.findall(
        r"DCGM_ERROR_TABLE_ENTRY\(\s*(DCGM_FR_\w+)\s*,\s*DCGM_ERROR_(\w+)\s*,\s*DCGM_FR_EC_(\w+)\s*\)",
        table.read_text(),
    )
    # dcgmErrorMeta is indexed by id: each row must sit at its own id, and the table end at the sentinel.
    assert [ids[name] for name, _, _ in rows] == list(range(len(rows)))
    assert ids["DCGM_FR_ERROR_SENTINEL"] == len(rows)
    return {ids[name]: (name, severity, category) for name, severity, category in rows}


def _enum(header: Path, name: str, prefix: str) -> dict[int, str]:
    block = re.search(rf"typedef enum {name}\s*\{{(.*?)\}}", header.read_text(), re.S)
    assert block
    return {int(v): k for k, v in re.findall(rf"{prefix}(\w+)\s*=\s*(\d+)", block.group(1))}


def test_medics_error_table_is_dcgm_4_6s() -> None:
    nvidia = _nvidia_table(NVIDIA / "dcgm_errors.h", NVIDIA / "dcgm_errors.c")
    ours = {e.id: (e.name, e.severity.value, e.category) for e in dcgm_errors.all_errors()}
    assert ours == nvidia
    assert max(ours) == 132


def test_the_tables_number_columns_and_the_output_codes_are_dcgms() -> None:
    severities = _enum(NVIDIA / "dcgm_errors.h", "dcgmErrorSeverity_enum", "DCGM_ERROR_")
    categories = _enum(NVIDIA / "dcgm_errors.h", "dcgmErrorCategory_enum", "DCGM_FR_EC_")
    assert {k: v.value for k, v in dcgm_errors.SEVERITY_IDS.items()} == {
        k: v for k, v in severities.items() if k
    }
    assert severities[0] == "NONE"
    assert categories == dcgm_errors.CATEGORY_IDS
    with (REPO_ROOT / "medic" / "data" / "dcgm_errors.csv").open(encoding="utf-8") as rows:
        for row in csv.DictReader(rows):
            assert severities[int(row["severity_id"])] == row["severity"], row
            assert categories[int(row["category_id"])] == row["category"], row


def test_dcgm_3_ids_mean_the_same_errors_in_the_4_6_table() -> None:
    old = _nvidia_table(NVIDIA / "dcgm_errors-3.3.9.h", NVIDIA / "dcgm_errors-3.3.9.c")
    new = _nvidia_table(NVIDIA / "dcgm_errors.h", NVIDIA / "dcgm_errors.c")
    # Names DCGM 4 renamed and kept as deprecated aliases in its header.
    aliases = dict(re.findall(r"(DCGM_FR_\w+)\s*=\s*(DCGM_FR_\w+)", (NVIDIA / "dcgm_errors.h").read_text()))
    changed = {}
    for error_id, (name, severity, category) in old.items():
        new_name, new_severity, new_category = new[error_id]
        assert aliases.get(name, name) == new_name, error_id
        if (severity, category) != (new_severity, new_category):
            changed[name] = ((severity, category), (new_severity, new_category))
    # What DCGM 3.3.9 says differently about the same error (medic reads DCGM 4.6's).
    assert changed == {
        "DCGM_FR_ROW_REMAP_FAILURE": (("ISOLATE", "HARDWARE_MEMORY"), ("RESET", "HARDWARE_MEMORY")),
        "DCGM_FR_BROKEN_P2P_MEMORY_DEVICE": (("ISOLATE", "HARDWARE_PCIE"), ("ISOLATE", "HARDWARE_OTHER")),
        "DCGM_FR_BROKEN_P2P_WRITER_DEVICE": (("ISOLATE", "HARDWARE_PCIE"), ("ISOLATE", "HARDWARE_OTHER")),
    }


@pytest.mark.parametrize(
    ("error_id", "name", "severity"),
    [
        (80, "DCGM_FR_ROW_REMAP_FAILURE", Severity.RESET),
        (118, "DCGM_FR_SRAM_THRESHOLD", Severity.ISOLATE),
        (120, "DCGM_FR_FALLEN_OFF_BUS", Severity.ISOLATE),
        (125, "DCGM_FR_GPU_RECOVERY_RESET", Severity.RESET),
        (129, "DCGM_FR_NCCL_ERROR", Severity.RESET),
        (131, "DCGM_FR_CONTAINED_ERROR", Severity.MONITOR),
        (132, "DCGM_FR_UNCORRECTABLE_ROW_REMAP_LIMIT", Severity.TRIAGE),
    ],
)
def test_dcgm_4_6_errors(error_id: int, name: str, severity: Severity) -> None:
    known = dcgm_errors.lookup(error_id)
    assert known is not None and (known.name, known.severity) == (name, severity)
    assert dcgm_errors.lookup(name) == known
    assert dcgm_errors.lookup(133) is None  # DCGM_FR_ERROR_SENTINEL
