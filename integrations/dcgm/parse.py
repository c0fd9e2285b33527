"""Reading `dcgmi diag -r N -j` output (DCGM 4 JSON, NVIDIA's schema) into typed results.

The raw models follow NVIDIA's JSON schema (tests/fixtures/dcgm/dcgm_diag_schema.json): a
field the schema requires is required here, so output cut short (a test without its summary,
a result without its status) is reported as partial instead of read as a pass.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from medic import dcgm_errors
from medic.dcgm_errors import Severity
from medic.errors import PermanentError
from medic.events import describe_validation_error

# The lowest `dcgmi diag -r` level that runs each test (DCGM 4, NvidiaValidationSuite).
TEST_LEVELS: dict[str, int] = {
    "software": 1,
    "memory": 2,
    "pcie": 2,
    "diagnostic": 3,
    "targeted_stress": 3,
    "targeted_power": 3,
    "memory_bandwidth": 3,
    "nvbandwidth": 3,
    "nccl_tests": 3,
    "eud": 3,
    "cpu_eud": 3,
    "rist": 3,
    "memtest": 4,
    "pulse_test": 4,
}


class DcgmOutputError(PermanentError, ValueError):
    """Raised when the text is not complete `dcgmi diag -j` output (DcgmDiagnostics turns it into an
    "error" verdict; it never leaves the integration)."""


# --- The JSON as dcgmi prints it ------------------------------------------------------------


class _Raw(BaseModel):
    # strict: "3" is not an error id; extra fields (info, aux data, newer DCGM keys) are fine.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class RawWarning(_Raw):
    error_category: int
    error_id: int
    error_severity: int
    warning: str


class RawResult(_Raw):
    entity_group: str
    entity_group_id: int
    entity_id: int
    status: str
    warnings: list[RawWarning] = Field(default_factory=list)
    info: list[str] = Field(default_factory=list)


class RawSummary(_Raw):
    status: str
    warnings: list[RawWarning] = Field(default_factory=list)


class RawTest(_Raw):
    name: str
    results: list[RawResult]
    test_summary: RawSummary


class RawCategory(_Raw):
    category: str
    tests: list[RawTest]


class RawDiagnostic(_Raw):
    test_categories: list[RawCategory] = Field(default_factory=list)
    runtime_error: str | None = None
    version: str | None = None  # where dcgmi puts its version when it reports a runtime error


class RawEntity(_Raw):
    device_id: str
    entity_id: int
    serial_num: str | None = None


class RawEntityGroup(_Raw):
    entities: list[RawEntity]
    entity_group: str
    entity_group_id: int


class RawMetadata(_Raw):
    version: str
    driver_version: str | None = Field(default=None, alias="Driver Version Detected")


class RawOutput(_Raw):
    diagnostic: RawDiagnostic = Field(alias="DCGM Diagnostic")
    entity_groups: list[RawEntityGroup] = Field(default_factory=list)
    metadata: RawMetadata | None = None


# --- What GPU Medic reads from it -----------------------------------------------------------


class Status(StrEnum):
    """A result's status, from least to most alarming."""

    SKIP = "skip"
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


# dcgmi leaves "Not Run" results out of its JSON, so they never reach this table.
_STATUSES = {"Pass": Status.PASS, "Skip": Status.SKIP, "Warn": Status.WARN, "Fail": Status.FAIL}


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"  # no verdict about the GPUs: the diagnostic did not (completely) run


@dataclass(frozen=True, slots=True)
class Finding:
    """One DCGM error a test reported, with DCGM's severity and category for its id."""

    test: str
    error_id: int
    name: str  # DCGM_FR_*, or the number when this DCGM release's table does not know it
    severity: Severity
    category: str
    message: str


@dataclass(frozen=True, slots=True)
class EntityResult:
    group: str  # GPU, Switch, CPU, ...
    entity_id: int
    status: Status
    findings: tuple[Finding, ...]


@dataclass(frozen=True, slots=True)
class TestResult:
    name: str
    category: str  # Deployment | Hardware | Integration | Stress
    status: Status
    results: tuple[EntityResult, ...]
    findings: tuple[Finding, ...]  # the summary's: every error of the test, tied to a GPU or not

    @property
    def failed(self) -> bool:
        return self.status is Status.FAIL or any(r.status is Status.FAIL for r in self.results)

    @property
    def failing(self) -> tuple[Finding, ...]:
        """Errors that made this test fail, for the test as a whole or for one of its entities."""
        found = [f for r in self.results if r.status is Status.FAIL for f in r.findings]
        if self.status is Status.FAIL:
            found.extend(self.findings)
        return _unique(found)


@dataclass(frozen=True, slots=True)
class EntityVerdict:
    """One GPU (or other entity) across every test of the run."""

    group: str
    entity_id: int
    status: Status  # the most alarming of its results
    findings: tuple[Finding, ...]


@dataclass(frozen=True, slots=True)
class DiagReport:
    tests: tuple[TestResult, ...]
    runtime_error: str | None
    dcgm_version: str | None
    driver_version: str | None
    verdict: Verdict
    reason: str  # why the verdict, in one line

    @property
    def failing(self) -> tuple[Finding, ...]:
        return _unique(f for t in self.tests for f in t.failing)

    @property
    def error_ids(self) -> tuple[str, ...]:
        """The failing DCGM_FR_* names, each once, in the order the tests reported them."""
        return tuple(dict.fromkeys(f.name for f in self.failing))

    @property
    def worst_severity(self) -> Severity | None:
        return dcgm_errors.worst(f.severity for f in self.failing)

    @property
    def level(self) -> int | None:
        """The `-r` level the tests that ran belong to; None when no test is a known one."""
        return max((TEST_LEVELS[t.name] for t in self.tests if t.name in TEST_LEVELS), default=None)

    def entities(self) -> list[EntityVerdict]:
        statuses: dict[tuple[str, int], list[Status]] = {}
        findings: dict[tuple[str, int], list[Finding]] = {}
        for test in self.tests:
            for result in test.results:
                key = (result.group, result.entity_id)
                statuses.setdefault(key, []).append(result.status)
                findings.setdefault(key, []).extend(result.findings)
        return [
            EntityVerdict(
                group,
                entity_id,
                max(statuses[(group, entity_id)], key=list(Status).index),
                _unique(findings[(group, entity_id)]),
            )
            for group, entity_id in sorted(statuses)
        ]


def _unique(findings: Iterable[Finding]) -> tuple[Finding, ...]:
    return tuple(dict.fromkeys(findings))


def _finding(test: str, raw: RawWarning) -> Finding:
    known = dcgm_errors.lookup(raw.error_id)
    if known is None:
        return Finding(test, raw.error_id, str(raw.error_id), Severity.UNKNOWN, "UNKNOWN", raw.warning)
    return Finding(test, raw.error_id, known.name, known.severity, known.category, raw.warning)


def _status(raw: str, where: str) -> Status:
    try:
        return _STATUSES[raw]
    except KeyError:
        raise DcgmOutputError(f"{where}: unknown status {raw!r}") from None


def _test(category: str, raw: RawTest) -> TestResult:
    results = tuple(
        EntityResult(
            r.entity_group,
            r.entity_id,
            _status(r.status, f"test {raw.name}, {r.entity_group} {r.entity_id}"),
            tuple(_finding(raw.name, w) for w in r.warnings),
        )
        for r in raw.results
    )
    summary = raw.test_summary
    return TestResult(
        raw.name,
        category,
        _status(summary.status, f"test {raw.name} summary"),
        results,
        tuple(_finding(raw.name, w) for w in summary.warnings),
    )


def _judge(tests: tuple[TestResult, ...], runtime_error: str | None) -> tuple[Verdict, str]:
    if runtime_error is not None:
        return Verdict.ERROR, f"DCGM reported a runtime error: {runtime_error.strip()}"
    if not tests:
        return Verdict.ERROR, "no test results in the output"
    failed = [t.name for t in tests if t.failed]
    if failed:
        return Verdict.FAIL, f"failed tests: {', '.join(failed)}"
    if {t.status for t in tests} | {r.status for t in tests for r in t.results} == {Status.SKIP}:
        return Verdict.ERROR, "every test was skipped"
    return Verdict.PASS, f"every test passed ({', '.join(t.name for t in tests)})"


def _load_json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        if not text.strip():
            raise DcgmOutputError("empty output") from None
        # Input that ends inside a string or right where more JSON was due was cut short.
        cut_short = error.msg.startswith("Unterminated string") or error.pos >= len(text.rstrip())
        hint = "truncated JSON" if cut_short else "not JSON"
        raise DcgmOutputError(f"{hint}: {error.msg} (line {error.lineno}, column {error.colno})") from None
    except RecursionError:
        raise DcgmOutputError("not dcgmi output: JSON nested too deeply") from None


def parse_report(text: str) -> DiagReport:
    """Parse the whole stdout of `dcgmi diag -j`; raises DcgmOutputError when it is not that."""
    data = _load_json(text)
    try:
        raw = RawOutput.model_validate(data)
    except ValidationError as error:
        raise DcgmOutputError(f"partial or unexpected output: {describe_validation_error(error)}") from None
    tests = tuple(_test(c.category, t) for c in raw.diagnostic.test_categories for t in c.tests)
    verdict, reason = _judge(tests, raw.diagnostic.runtime_error)
    return DiagReport(
        tests=tests,
        runtime_error=raw.diagnostic.runtime_error,
        dcgm_version=raw.metadata.version if raw.metadata else raw.diagnostic.version,
        driver_version=raw.metadata.driver_version if raw.metadata else None,
        verdict=verdict,
        reason=reason,
    )
