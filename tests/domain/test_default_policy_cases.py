"""The default policy's own test cases (policies/default.tests.yaml) pass and cover every rule."""

from __future__ import annotations

from checkout import REPO_ROOT

from medic.policy import load_policy
from medic.whatif.testing import default_tests_path, load_tests, run_tests

POLICY = REPO_ROOT / "policies" / "default.yaml"


def test_every_case_passes() -> None:
    loaded = load_policy(POLICY)
    results = run_tests(loaded, load_tests(default_tests_path(POLICY)))
    failures = {r.name: r.differences for r in results if not r.passed}
    assert failures == {}
    assert len(results) >= 30


def test_every_rule_has_a_case() -> None:
    loaded = load_policy(POLICY)
    tests = load_tests(default_tests_path(POLICY))
    expected_rules = {t.expect.rule for t in tests.tests if t.expect.rule}
    assert {r.id for r in loaded.policy.rules} <= expected_rules


def test_every_guardrail_of_the_default_has_a_case() -> None:
    tests = load_tests(default_tests_path(POLICY))
    assert {t.expect.guardrail for t in tests.tests if t.expect.guardrail} >= {
        "circuit_breaker",
        "node_cooldown",
    }
