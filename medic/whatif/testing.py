"""`medic policy test`: SREs' own test cases for a policy, kept next to it.

A test gives events (and so the node's history) and expects a decision. Events need only
`kind` and `node`; `id`, `source` and `time` are filled in, and `minutes_ago` / `hours_ago` /
`days_ago` place an event before the test's moment (default: one second apart, in order).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from medic.events import FaultEvent, describe_validation_error
from medic.policy.loader import LoadedPolicy, PolicyError, PolicyProblem, parse_yaml
from medic.policy.model import Action, Classification
from medic.triage import triage

MOMENT = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
_AGO = {"minutes_ago": "minutes", "hours_ago": "hours", "days_ago": "days"}


class Expect(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node: str | None = Field(
        None,
        description="Check the latest incident about this node, or this switch (default: the last one).",
    )
    action: Action | None = None
    classification: Classification | None = None
    rule: str | None = None
    diagnose_level: int | None = None
    guardrail: str | None = None
    approve: bool | None = Field(None, description="Whether a human must approve the action first.")


class PolicyTest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    events: list[dict[str, Any]] = Field(min_length=1)
    fleet_size: int | None = Field(None, gt=0)
    expect: Expect


class PolicyTests(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tests: list[PolicyTest]


@dataclass(frozen=True, slots=True)
class TestResult:
    name: str
    passed: bool
    differences: tuple[str, ...]  # "action: expected reboot, got replace"
    rule: str


def default_tests_path(policy_path: Path) -> Path:
    return policy_path.with_name(f"{policy_path.stem}.tests.yaml")


def load_tests(path: Path) -> PolicyTests:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise PolicyError([PolicyProblem(str(path), 0, 0, f"cannot read: {error.strerror}")]) from None
    return parse_yaml(text, str(path), PolicyTests, "a mapping with `tests:`")


def _events(test: PolicyTest, index: int) -> list[FaultEvent]:
    events = []
    for number, raw in enumerate(test.events):
        fields = dict(raw)
        at = MOMENT - timedelta(seconds=len(test.events) - number)
        for key, unit in _AGO.items():
            if key in fields:
                at = MOMENT - timedelta(**{unit: float(fields.pop(key))})
        fields.setdefault("id", f"test{index}-{number}")
        fields.setdefault("source", "policy-test")
        fields.setdefault("time", at)
        try:
            events.append(FaultEvent.model_validate(fields))
        except ValidationError as error:
            raise ValueError(
                f"test {test.name!r}, event {number + 1}: {describe_validation_error(error)}"
            ) from None
    return events


def run_test(loaded: LoadedPolicy, test: PolicyTest, index: int = 0) -> TestResult:
    results = list(triage(_events(test, index), loaded, test.fleet_size))
    expect = test.expect
    chosen = [(i, d) for i, d in results if expect.node is None or expect.node in (i.node, *i.nodes)]
    if not chosen:
        return TestResult(test.name, False, (f"no incident on node {expect.node}",), "-")
    _, decision = chosen[-1]
    differences = []
    for field_name in ("action", "classification", "rule", "diagnose_level", "guardrail", "approve"):
        wanted = getattr(expect, field_name)
        if wanted is None:
            continue
        got = getattr(decision, field_name)
        if got != wanted:
            shown = got.value if hasattr(got, "value") else got
            wanted_shown = wanted.value if hasattr(wanted, "value") else wanted
            differences.append(f"{field_name}: expected {wanted_shown}, got {shown}")
    return TestResult(test.name, not differences, tuple(differences), decision.rule)


def run_tests(loaded: LoadedPolicy, tests: PolicyTests) -> list[TestResult]:
    return [run_test(loaded, test, index) for index, test in enumerate(tests.tests)]
