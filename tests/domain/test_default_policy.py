"""The default policy (policies/default.yaml), scenario by scenario: events in, decision out."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from checkout import REPO_ROOT
from factories import fault_event

from medic.events import FaultEvent
from medic.facts import facts_of
from medic.incidents import correlate
from medic.policy import Decision, decide, load_policy

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"


# event(kind, minutes=..., **attributes): `minutes` after T0 (negative: before).
event = partial(fault_event, node="node-a", gpu=0)


def xid(code: int, **kw: Any) -> FaultEvent:
    return event("xid", code=code, **kw)


def dcgm(error_id: int | str, **kw: Any) -> FaultEvent:
    return event("dcgm_health", error_id=error_id, **kw)


def diag(level: int, result: str, *error_ids: int | str, **kw: Any) -> FaultEvent:
    return event("diagnostic", level=level, result=result, error_ids=list(error_ids), **kw)


def remediation(days_ago: float, action: str = "reboot") -> FaultEvent:
    return event("remediation", minutes=-days_ago * 24 * 60, action=action)


@pytest.fixture(scope="module")
def loaded():
    return load_policy(DEFAULT_POLICY)


def decide_events(loaded, events: list[FaultEvent], *, out_of_service: bool = False) -> Decision:
    incidents = correlate(events)
    assert len(incidents) == 1, "each scenario is one incident"
    facts = facts_of(incidents[0], out_of_service=out_of_service)
    return decide(loaded.policy, facts, loaded.sha256)


# (scenario id, events, out_of_service, action, classification, rule, diagnose_level)
SCENARIOS: list[tuple[str, list[FaultEvent], bool, str, str, str, int | None]] = [
    ("xid-79", [xid(79)], False, "reboot", "hardware", "xid-fallen-off-bus", None),
    (
        "gpu-missing",
        [event("gpu_missing", expected=8, found=7)],
        False,
        "reboot",
        "hardware",
        "gpu-missing",
        None,
    ),
    (
        "node-unreachable",
        [event("node_unreachable", gpu=None)],
        False,
        "reboot",
        "hardware",
        "node-unreachable",
        None,
    ),
    *[
        (f"xid-{code}", [xid(code)], False, "reset_gpu", "hardware", "xid-reset-gpu", None)
        for code in (48, 62, 64, 95, 109, 119, 120, 136, 140, 143)
    ],
    ("ecc-dbe", [event("ecc", dbe=2, sbe=10)], False, "reset_gpu", "hardware", "ecc-double-bit", None),
    *[
        (f"app-xid-{code}", [xid(code)], False, "none", "software", "application-xid", None)
        for code in (13, 31, 43, 94)
    ],
    ("nan-loss", [event("nan_loss")], False, "none", "software", "application-fault", None),
    ("job-crash", [event("job_crash", exit_code=1)], False, "none", "software", "application-fault", None),
    (
        "nan-loss-with-xid-79",
        [event("nan_loss"), xid(79, minutes=1)],
        False,
        "reboot",
        "hardware",
        "xid-fallen-off-bus",
        None,
    ),
    (
        "dcgm-isolate-name",
        [dcgm("DCGM_FR_FAULTY_MEMORY")],
        False,
        "diagnose",
        "hardware",
        "dcgm-health-isolate",
        2,
    ),
    ("dcgm-isolate-id", [dcgm(52)], False, "diagnose", "hardware", "dcgm-health-isolate", 2),
    ("dcgm-isolate-id-str", [dcgm("52")], False, "diagnose", "hardware", "dcgm-health-isolate", 2),
    (
        "dcgm-reset",
        [dcgm("DCGM_FR_PENDING_PAGE_RETIREMENTS")],
        False,
        "reset_gpu",
        "hardware",
        "dcgm-health-reset",
        None,
    ),
    ("dcgm-triage", [dcgm("DCGM_FR_NVLINK_DOWN")], False, "diagnose", "hardware", "dcgm-health-triage", 1),
    ("nccl-timeout", [event("nccl_timeout")], False, "diagnose", "unknown", "lone-nccl-timeout", 1),
    (
        "straggler-3",
        [event("straggler", minutes=m, step_time_ratio=r) for m, r in ((0, 1.1), (1, 1.3), (2, 1.25))],
        False,
        "diagnose",
        "hardware",
        "sustained-straggler",
        2,
    ),
    (
        "straggler-2",
        [event("straggler", minutes=m, step_time_ratio=1.5) for m in (0, 1)],
        False,
        "none",
        "unknown",
        "default",
        None,
    ),
    (
        "diag-isolate",
        [diag(2, "fail", "DCGM_FR_FAULTY_MEMORY")],
        False,
        "replace",
        "hardware",
        "diag-isolate",
        None,
    ),
    (
        "diag-isolate-after-health",
        [dcgm(52), diag(2, "fail", 52, minutes=5)],
        True,
        "replace",
        "hardware",
        "diag-isolate",
        None,
    ),
    (
        "diag-reset",
        [diag(1, "fail", "DCGM_FR_PENDING_PAGE_RETIREMENTS")],
        False,
        "reset_gpu",
        "hardware",
        "diag-reset",
        None,
    ),
    (
        "diag-triage",
        [diag(1, "fail", "DCGM_FR_NVLINK_DOWN")],
        False,
        "diagnose",
        "hardware",
        "diag-triage-climb",
        2,
    ),
    (
        "diag-triage-after-health",
        [dcgm("DCGM_FR_NVLINK_DOWN"), diag(1, "fail", 14, minutes=5)],
        False,
        "diagnose",
        "hardware",
        "diag-triage-climb",
        2,
    ),
    (
        "diag-config",
        [diag(1, "fail", "DCGM_FR_PERSISTENCE_MODE")],
        False,
        "escalate",
        "infrastructure",
        "diag-config",
        None,
    ),
    ("diag-pass-out", [diag(1, "pass")], True, "reintegrate", "hardware", "diag-pass-reintegrate", None),
    ("diag-pass-in", [diag(1, "pass")], False, "none", "unknown", "diag-pass", None),
    (
        "nccl-then-pass",
        [event("nccl_timeout"), diag(1, "pass", minutes=5)],
        False,
        "none",
        "unknown",
        "diag-pass",
        None,
    ),
    (
        "repeat-offender",
        [remediation(days_ago=1), xid(79)],
        False,
        "replace",
        "hardware",
        "repeat-offender-replace",
        None,
    ),
    (
        "repeat-offender-escalate",
        [*(remediation(days_ago=d) for d in (0.5, 1, 2, 4, 6)), xid(79)],
        False,
        "escalate",
        "hardware",
        "repeat-offender-escalate",
        None,
    ),
    (
        "repeat-offender-escalate-software",
        [*(remediation(days_ago=d) for d in (0.5, 1, 2, 4, 6)), event("nccl_timeout")],
        False,
        "escalate",
        "hardware",
        "repeat-offender-escalate",
        None,
    ),
    (
        "old-remediations-do-not-count",
        [*(remediation(days_ago=d) for d in (8, 9, 10, 11, 12)), xid(79)],
        False,
        "reboot",
        "hardware",
        "xid-fallen-off-bus",
        None,
    ),
]


@pytest.mark.parametrize(
    ("events", "out_of_service", "action", "classification", "rule", "level"),
    [pytest.param(*rest, id=name) for name, *rest in SCENARIOS],
)
def test_default_policy(loaded, events, out_of_service, action, classification, rule, level):
    decision = decide_events(loaded, events, out_of_service=out_of_service)
    assert (decision.action, decision.classification, decision.rule, decision.diagnose_level) == (
        action,
        classification,
        rule,
        level,
    ), decision.reason
    assert decision.policy_sha256 == loaded.sha256


def test_scenario_ids_are_unique():
    names = [name for name, *_ in SCENARIOS]
    assert len(names) == len(set(names))


def test_repeat_offender_recommends_vendor_case(loaded):
    events = [*(remediation(days_ago=d) for d in (1, 2, 3, 4, 5)), xid(79)]
    decision = decide_events(loaded, events)
    assert any("vendor" in r for r in decision.recommend)
    assert "5 remediations" in decision.reason


def test_dcgm_isolate_diagnose_is_satisfied_by_its_level(loaded):
    """After the requested level-2 run passes, the health rule no longer asks for it again."""
    events = [dcgm("DCGM_FR_FAULTY_MEMORY"), diag(2, "pass", minutes=5)]
    decision = decide_events(loaded, events, out_of_service=True)
    assert decision.action == "reintegrate"
    assert "dcgm-health-isolate" not in decision.matched


def test_triage_climb_escalates_after_level_4(loaded):
    events = [diag(level, "fail", "DCGM_FR_NVLINK_DOWN", minutes=level) for level in (1, 2, 3, 4)]
    decision = decide_events(loaded, events)
    assert decision.rule == "diag-triage-climb"
    assert decision.action == "escalate"
    assert decision.diagnose_level is None
    assert "exhausted at level 4" in decision.reason
