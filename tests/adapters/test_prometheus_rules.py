"""The shipped Prometheus rules (deployments/prometheus/) through the real `promtool` (Debian's
`prometheus` package; scripts/test.sh installs it): both files load, and each alert's promtool unit
tests (deployments/prometheus/tests/) pass, firing and not firing.

Also the contract with `POST /v1/alertmanager`: every dcgm-exporter rule names its metric in the
`dcgm_field` label and carries the value annotation, and names only metrics dcgm-exporter exports."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from checkout import REPO_ROOT

RULES = REPO_ROOT / "deployments" / "prometheus"
RULE_FILES = sorted(RULES.glob("*.rules.yml"))
UNIT_TESTS = sorted((RULES / "tests").glob("*.yml"))
# dcgm-exporter's field names, from NVIDIA/dcgm-exporter etc/default-counters.csv (on or commented out).
DCGM_FIELDS = {
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "DCGM_FI_DEV_THERMAL_VIOLATION",
    "DCGM_FI_DEV_POWER_VIOLATION",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
}


def promtool(*args: str | Path) -> None:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is missing: scripts/test.sh installs Debian's prometheus package")
    done = subprocess.run([exe, *map(str, args)], cwd=RULES, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"promtool {' '.join(map(str, args))} failed:\n{done.stdout}{done.stderr}"


def test_there_are_rules_and_tests() -> None:
    assert [p.name for p in RULE_FILES] == ["dcgm-exporter.rules.yml", "gpu-medic.rules.yml"]
    assert [p.name for p in UNIT_TESTS] == ["dcgm-exporter.test.yml", "gpu-medic.test.yml"]


def test_promtool_check_rules() -> None:
    promtool("check", "rules", *RULE_FILES)


@pytest.mark.parametrize("unit", UNIT_TESTS, ids=lambda p: p.name)
def test_promtool_test_rules(unit: Path) -> None:
    promtool("test", "rules", unit)


def test_every_alert_has_unit_tests_firing_and_not() -> None:
    tested: dict[str, set[bool]] = {}
    for unit in UNIT_TESTS:
        for case in yaml.safe_load(unit.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                tested.setdefault(check["alertname"], set()).add(bool(check.get("exp_alerts")))
    alerts = {
        rule["alert"]
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    }
    assert {name: tested.get(name, set()) for name in alerts} == {name: {True, False} for name in alerts}


def test_dcgm_rules_keep_the_alertmanager_route_contract() -> None:
    rules = yaml.safe_load((RULES / "dcgm-exporter.rules.yml").read_text())["groups"][0]["rules"]
    assert {rule["labels"]["dcgm_field"] for rule in rules} == DCGM_FIELDS
    for rule in rules:
        field = rule["labels"]["dcgm_field"]
        assert field in rule["expr"], rule["alert"]
        assert rule["annotations"]["value"] == "{{ $value }}", rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert "by (" not in rule["expr"] and "without" not in rule["expr"], "keeps Hostname, gpu"
