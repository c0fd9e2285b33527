"""Reading `dcgmi diag -r N -j` output (DCGM 3.x and 4.x JSON) into typed results.

Which layout a document has is read from the document itself: DCGM 4 puts its results under
"DCGM Diagnostic" (with `entity_groups` and `metadata`), DCGM 3 under "DCGM GPU Diagnostic"
(with a top-level `version`); anything else is refused. Both become the same DiagReport.

The DCGM 4 models follow NVIDIA's JSON schema (tests/fixtures/dcgm/dcgm_diag_schema.json): a
field the schema requires is required here, so output cut short (a test without its summary,
a result without its status) is reported as partial instead of read as a pass. The DCGM 3
models follow what DCGM 3's `dcgmi/Diag.cpp` prints and NVIDIA's 3.3 schema
(tests/fixtures/dcgm/v3/).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

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

# DCGM 3 prints display names, and each deployment check as a test of its own (dcgmi/Diag.cpp).
DEPLOYMENT_TESTS_3 = (
    "Denylist",
    "NVML Library",
    "CUDA Main Library",
    "Permissions and OS Blocks",
    "Persistence Mode",
    "Environment Variables",
    "Page Retirement/Row Remap",
    "Graphics Processes",
    "Inforom",
)
TEST_LEVELS_3: dict[str, int] = {
    **dict.fromkeys(DEPLOYMENT_TESTS_3, 1),
    "CUDA Toolkit Library": 1,  # not run by DCGM 3 (left out of its output)
    "GPU Memory": 2,
    "PCIe": 2,
    "Diagnostic": 3,
    "SM Stress": 3,
    "Targeted Stress": 3,
    "Targeted Power": 3,
    "Memory Bandwidth": 3,
    "EUD Test": 3,
    "CPU EUD Test": 3,
    "Memtest": 4,
    "Pulse Test": 4,
}

# The tests every run of a level must report, per DCGM major version; the rest (eud, cpu_eud,
# nvbandwidth, nccl_tests, rist) run only where they are installed, allowed or run as root.
REQUIRED_TESTS: dict[int, dict[int, tuple[str, ...]]] = {
    4: {
        1: ("software",),
        2: ("memory", "pcie"),
        3: ("diagnostic", "targeted_stress", "targeted_power", "memory_bandwidth"),
        4: ("memtest", "pulse_test"),
    },
    3: {
        1: DEPLOYMENT_TESTS_3,
        2: ("GPU Memory", "PCIe"),
        3: ("Diagnostic", "Targeted Stress", "Targeted Power", "Memory Bandwidth"),
        4: ("Memtest", "Pulse Test"),
    },
}
LEVEL_OF: dict[int, dict[str, int]] = {4: TEST_LEVELS, 3: TEST_LEVELS_3}

DCGM4_KEY = "DCGM Diagnostic"
DCGM3_KEY = "DCGM GPU Diagnostic"


_M = TypeVar("_M", bound=BaseModel)


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
    info: list[str] = Field(default_factory=list)


class RawTest(_Raw):
    name: str
    # dcgmi leaves both out for a test that did not run (Diag.cpp, HelperJsonAddResult and
    # HelperJsonAddTestSummary skip DCGM_DIAG_RESULT_NOT_RUN); one without the other is partial.
    results: list[RawResult] | None = None
    test_summary: RawSummary | None = None


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
    diagnostic: RawDiagnostic = Field(alias=DCGM4_KEY)
    entity_groups: list[RawEntityGroup] = Field(default_factory=list)
    metadata: RawMetadata | None = None


# DCGM 3.x (dcgmi/Diag.cpp at v3.0-v3.3): no entity groups, no test summaries, GPUs by index.


class RawWarning3(_Raw):
    error_id: int
    error_category: int | None = None
    error_severity: int | None = None
    warning: str | None = None
    warnings: str | None = None  # DCGM 3.3's deployment tests put the message under this key

    @property
    def message(self) -> str:
        return self.warning if self.warning is not None else self.warnings or ""


class RawResult3(_Raw):
    status: str
    gpu_id: str | int | None = None  # 3.3: the GPU index as text (an int in deployment tests)
    gpu_ids: str | None = None  # 3.0-3.2: the same, under this name
    warnings: list[RawWarning3] | str | None = None  # 3.0-3.2: one message, its id in error_id
    error_id: int | None = None
    info: str | None = None


class RawTest3(_Raw):
    name: str
    results: list[RawResult3]


class RawCategory3(_Raw):
    category: str
    tests: list[RawTest3]


class RawDiagnostic3(_Raw):
    test_categories: list[RawCategory3] = Field(default_factory=list)
    runtime_error: str | None = None
    version: str | None = None


class RawOutput3(_Raw):
    diagnostic: RawDiagnostic3 = Field(alias=DCGM3_KEY)
    version: str | None = None  # 3.1 and later
    driver_version: str | None = Field(default=None, alias="Driver Version Detected")


# --- What GPU Medic reads from it -----------------------------------------------------------


class Status(StrEnum):
    """A result's status, from least to most alarming."""

    NOT_RUN = "not run"
    SKIP = "skip"
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


# dcgmi leaves "Not Run" results out of its JSON (DCGM 3 prints a warning as "Fail").
_STATUSES = {
    "Pass": Status.PASS,
    "Skip": Status.SKIP,
    "Warn": Status.WARN,
    "Fail": Status.FAIL,
    "Not Run": Status.NOT_RUN,
}
_DID_NOT_RUN = frozenset({Status.SKIP, Status.NOT_RUN})


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    # Some test the level is made of was skipped or did not run: no verdict about the GPUs it
    # left out, so never a pass (DcgmDiagnostics reports it as "error").
    INCOMPLETE = "incomplete"
    ERROR = "error"  # no verdict about the GPUs: the diagnostic did not (completely) run


@dataclass(frozen=True, slots=True)
class Finding:
    """One DCGM error a test reported, with DCGM's severity and category for its id."""

    test: str
    error_id: int | None  # None: DCGM 3.0-3.1 print a message without its id
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
    info: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TestResult:
    name: str
    category: str  # Deployment | Hardware | Integration | Stress
    status: Status
    results: tuple[EntityResult, ...]
    findings: tuple[Finding, ...]  # the summary's: every error of the test, tied to a GPU or not
    info: tuple[str, ...] = ()  # the summary's notes that belong to no entity

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
class Gap:
    """A test of the run's level that did not run on everything it should have."""

    test: str
    level: int | None
    status: str  # "skipped" | "not run" (the output says so) | "missing" (the output lacks it)
    where: tuple[str, ...]  # the entities left out ("GPU 3"); () for the test as a whole
    reason: str
    # A test every run of the level is made of, or one of unknown level: without it the run is
    # incomplete. An optional test of a known level (nccl_tests, eud, …) that a site does not
    # allow is listed, but does not stop a level from passing on the tests that define it.
    required: bool = True

    def describe(self, limit: int = 200) -> str:
        where = f" on {', '.join(self.where)}" if self.where else ""
        reason = self.reason if len(self.reason) <= limit else self.reason[:limit] + "…"
        optional = "" if self.required else "; optional, the level does not need it"
        return f"{self.test} {self.status}{where} ({reason}{optional})"


@dataclass(frozen=True, slots=True)
class EntityVerdict:
    """One GPU (or other entity) across every test of the run."""

    group: str
    entity_id: int
    status: Status  # the most alarming of its results
    findings: tuple[Finding, ...]


NO_REASON = "no reason given in the output"


@dataclass(frozen=True, slots=True)
class DiagReport:
    tests: tuple[TestResult, ...]
    runtime_error: str | None
    dcgm_version: str | None
    driver_version: str | None
    verdict: Verdict  # judged at `level`, the level the output's own tests show
    reason: str  # why the verdict, in one line
    dcgm_major: int = 4  # which layout the output had: 3 or 4

    @property
    def failing(self) -> tuple[Finding, ...]:
        return _unique(f for t in self.tests for f in t.failing)

    @property
    def error_ids(self) -> tuple[str, ...]:
        """The failing DCGM_FR_* names, each once, in the order the tests reported them."""
        return tuple(dict.fromkeys(f.name for f in self.failing if f.error_id is not None))

    @property
    def worst_severity(self) -> Severity | None:
        return dcgm_errors.worst(f.severity for f in self.failing)

    def level_of(self, test: str) -> int | None:
        return LEVEL_OF[self.dcgm_major].get(test)

    @property
    def level(self) -> int | None:
        """The `-r` level the tests that ran belong to; None when no test is a known one."""
        return max((lv for t in self.tests if (lv := self.level_of(t.name)) is not None), default=None)

    def gaps(self, level: int | None) -> tuple[Gap, ...]:
        """What a `-r level` run left out: tests (or some of their entities) skipped or not run,
        and, for a known level, the tests every run of it reports that are missing. A skipped
        test of unknown level counts too: nothing says it is not part of the level."""
        found: list[Gap] = []
        required = REQUIRED_TESTS[self.dcgm_major]
        core = {name for lv, names in required.items() if level is None or lv <= level for name in names}
        for test in self.tests:
            test_level = self.level_of(test.name)
            if level is not None and test_level is not None and test_level > level:
                continue
            gap = _gap(test, test_level, test_level is None or test.name in core)
            if gap is not None:
                found.append(gap)
        if level is not None:
            present = {t.name for t in self.tests}
            for lv in range(1, level + 1):
                found.extend(
                    Gap(
                        name,
                        lv,
                        "missing",
                        (),
                        f"a level-{level} run includes it; the output has no result for it",
                    )
                    for name in required.get(lv, ())
                    if name not in present
                )
        return tuple(found)

    def judge(self, level: int | None) -> tuple[Verdict, str]:
        """The verdict of this output for a `-r level` run, and why, in one line."""
        if self.runtime_error is not None:
            return Verdict.ERROR, f"DCGM reported a runtime error: {self.runtime_error.strip()}"
        if not self.tests:
            return Verdict.ERROR, "no test results in the output"
        failed = [t.name for t in self.tests if t.failed]
        if failed:
            return Verdict.FAIL, f"failed tests: {', '.join(failed)}"
        statuses = {t.status for t in self.tests} | {r.status for t in self.tests for r in t.results}
        if statuses == {Status.SKIP}:
            return Verdict.ERROR, "every test was skipped"
        if statuses <= _DID_NOT_RUN:
            return Verdict.ERROR, "no test ran (every test was skipped or not run)"
        gaps = [g for g in self.gaps(level) if g.required]
        if gaps:
            return Verdict.INCOMPLETE, "not every test of the level ran: " + "; ".join(
                g.describe() for g in gaps
            )
        return Verdict.PASS, f"every test passed ({', '.join(t.name for t in self.tests)})"

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


def _reason(findings: Iterable[Finding], info: Iterable[str]) -> str:
    said = dict.fromkeys([*(f.message.strip() for f in findings), *(i.strip() for i in info)])
    return "; ".join(m for m in said if m) or NO_REASON


def _gap(test: TestResult, level: int | None, required: bool) -> Gap | None:
    left_out = [r for r in test.results if r.status in _DID_NOT_RUN]
    if test.status in _DID_NOT_RUN:
        status = "not run" if test.status is Status.NOT_RUN else "skipped"
        where = tuple(f"{r.group} {r.entity_id}" for r in left_out)
        if left_out and len(left_out) == len(test.results):
            where = ()  # every entity: the test as a whole
        findings = [*test.findings, *(f for r in left_out for f in r.findings)]
        info = [*test.info, *(i for r in left_out for i in r.info)]
        return Gap(test.name, level, status, where, _reason(findings, info), required)
    if left_out:
        return Gap(
            test.name,
            level,
            "skipped",
            tuple(f"{r.group} {r.entity_id}" for r in left_out),
            _reason((f for r in left_out for f in r.findings), (i for r in left_out for i in r.info)),
            required,
        )
    return None


def _finding(
    test: str, error_id: int | None, message: str, severity: int | None, category: int | None
) -> Finding:
    if error_id is None:
        return Finding(test, None, "(no error id)", Severity.UNKNOWN, "UNKNOWN", message)
    # DCGM's table for the ids it knows; for a newer id, what the output says about it.
    known = dcgm_errors.lookup(error_id) or dcgm_errors.stated(error_id, severity, category)
    return Finding(test, error_id, known.name, known.severity, known.category, message)


def _warning(test: str, raw: RawWarning) -> Finding:
    return _finding(test, raw.error_id, raw.warning, raw.error_severity, raw.error_category)


def _status(raw: str, where: str) -> Status:
    try:
        return _STATUSES[raw]
    except KeyError:
        raise DcgmOutputError(f"{where}: unknown status {raw!r}") from None


def _test(category: str, raw: RawTest) -> TestResult:
    if raw.results is None and raw.test_summary is None:
        return TestResult(raw.name, category, Status.NOT_RUN, (), ())
    if raw.results is None or raw.test_summary is None:
        missing = "results" if raw.results is None else "test_summary"
        raise DcgmOutputError(f"partial or unexpected output: test {raw.name}: {missing}: Field required")
    results = tuple(
        EntityResult(
            r.entity_group,
            r.entity_id,
            _status(r.status, f"test {raw.name}, {r.entity_group} {r.entity_id}"),
            tuple(_warning(raw.name, w) for w in r.warnings),
            tuple(r.info),
        )
        for r in raw.results
    )
    summary = raw.test_summary
    return TestResult(
        raw.name,
        category,
        _status(summary.status, f"test {raw.name} summary"),
        results,
        tuple(_warning(raw.name, w) for w in summary.warnings),
        tuple(summary.info),
    )


def _gpu_index(raw: RawResult3, test: str) -> int | None:
    """The GPU a DCGM 3 result is about; None for a result about the node (deployment tests)."""
    value = raw.gpu_id if raw.gpu_id is not None else raw.gpu_ids
    if value is None:
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if value.isdigit():
        return int(value)
    raise DcgmOutputError(f"test {test}: GPU id {value!r} is not a GPU index")


def _findings3(test: str, raw: RawResult3) -> tuple[Finding, ...]:
    if isinstance(raw.warnings, str):
        return (_finding(test, raw.error_id, raw.warnings, None, None),)
    return tuple(
        _finding(test, w.error_id, w.message, w.error_severity, w.error_category) for w in raw.warnings or ()
    )


def _test3(category: str, raw: RawTest3) -> TestResult:
    if not raw.results:
        raise DcgmOutputError(f"partial or unexpected output: test {raw.name} has no results")
    results: list[EntityResult] = []
    node_statuses: list[Status] = []
    node_findings: list[Finding] = []
    node_info: list[str] = []
    for r in raw.results:
        gpu = _gpu_index(r, raw.name)
        status = _status(r.status, f"test {raw.name}" + (f", GPU {gpu}" if gpu is not None else ""))
        findings = _findings3(raw.name, r)
        info = (r.info,) if r.info else ()
        if gpu is None:
            node_statuses.append(status)
            node_findings.extend(findings)
            node_info.extend(info)
        else:
            results.append(EntityResult("GPU", gpu, status, findings, info))
    # No test summary in DCGM 3: the test is as alarming as its most alarming result.
    status = max([*node_statuses, *(r.status for r in results)], key=list(Status).index)
    return TestResult(raw.name, category, status, tuple(results), _unique(node_findings), tuple(node_info))


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


def _major(version: str | None, layout: int) -> None:
    """Refuse a version that contradicts the layout (or a DCGM this parser does not know)."""
    if version is None:
        return
    head = version.strip().split(".", 1)[0]
    if not head.isdigit():
        raise DcgmOutputError(f"unexpected output: DCGM version {version!r} is not a version number")
    major = int(head)
    if major not in (3, 4):
        raise DcgmOutputError(f"unsupported DCGM {version}: this parser reads DCGM 3.x and 4.x output")
    if major != layout:
        raise DcgmOutputError(f"unexpected output: DCGM {version} in the DCGM {layout} layout")


def _validate(model: type[_M], data: object) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise DcgmOutputError(f"partial or unexpected output: {describe_validation_error(error)}") from None


def _parse4(data: object) -> DiagReport:
    raw = _validate(RawOutput, data)
    _major(raw.metadata.version if raw.metadata else None, 4)
    _major(raw.diagnostic.version, 4)
    tests = tuple(_test(c.category, t) for c in raw.diagnostic.test_categories for t in c.tests)
    return _report(
        tests,
        raw.diagnostic.runtime_error,
        raw.metadata.version if raw.metadata else raw.diagnostic.version,
        raw.metadata.driver_version if raw.metadata else None,
        4,
    )


def _parse3(data: object) -> DiagReport:
    raw = _validate(RawOutput3, data)
    _major(raw.version, 3)
    _major(raw.diagnostic.version, 3)
    tests = tuple(_test3(c.category, t) for c in raw.diagnostic.test_categories for t in c.tests)
    return _report(
        tests, raw.diagnostic.runtime_error, raw.version or raw.diagnostic.version, raw.driver_version, 3
    )


def _report(
    tests: tuple[TestResult, ...],
    runtime_error: str | None,
    version: str | None,
    driver: str | None,
    major: int,
) -> DiagReport:
    report = DiagReport(tests, runtime_error, version, driver, Verdict.ERROR, "", major)
    verdict, reason = report.judge(report.level)
    return DiagReport(tests, runtime_error, version, driver, verdict, reason, major)


def parse_report(text: str) -> DiagReport:
    """Parse the whole stdout of `dcgmi diag -j` (DCGM 3.x or 4.x, told apart by the document's
    own layout and version); raises DcgmOutputError when it is not that."""
    data = _load_json(text)
    if not isinstance(data, dict):
        raise DcgmOutputError(f"partial or unexpected output: a JSON {type(data).__name__}, not an object")
    has4, has3 = DCGM4_KEY in data, DCGM3_KEY in data
    if has4 and has3:
        raise DcgmOutputError(f"unexpected output: both {DCGM4_KEY!r} (DCGM 4) and {DCGM3_KEY!r} (DCGM 3)")
    if has3:
        return _parse3(data)
    if has4:
        return _parse4(data)
    raise DcgmOutputError(
        f"partial or unexpected output: no {DCGM4_KEY!r} (DCGM 4) or {DCGM3_KEY!r} (DCGM 3) object"
    )
