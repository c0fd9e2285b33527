"""Why the straggler is slow, in the policy and before people (docs/culprit.md, decision 0022).

Straggler events carry the verdict of the slow rank's profile against a healthy peer's
(`ProfileDiff.facts()` plus its evidence and the peer's trace). The facts expose the latest one; a
rule's `straggler_cause` matches it; the default policy takes the node out only for a hardware cause;
the message and the audit show the cause, where, what grew, and both traces.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from checkout import REPO_ROOT
from factories import fault_event, incident
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.artifacts import Artifact, artifacts_of
from medic.audit import incident_markdown
from medic.facts import CauseEvidence, facts_of, straggler_verdict
from medic.incidents import Incident
from medic.policy import Action, Classification, decide, load_policy
from medic.policy.loader import PolicyError, parse_policy
from medic.profile_diff import Cause
from medic.store import Store

DEFAULT = load_policy(REPO_ROOT / "policies" / "default.yaml").policy
SUSPECT_TRACE = "/shared/medic/llm-r2-step16-profile.pt.trace.json"
PEER_TRACE = "/shared/medic/llm-r0-step16-profile.pt.trace.json"
ADDMM = {"name": "aten::addmm [64x32]", "category": "compute", "grew_s": 0.0041, "ratio": 1.92}
LINEAR = {
    "name": "aten::linear [[32,16],[64,16],[64]]",
    "category": "compute",
    "grew_s": 0.0012,
    "ratio": 1.3,
}


def said(cause: str, where: str | None = "aten::addmm [64x32]", **more: Any) -> dict[str, Any]:
    """A straggler's attributes as `medic serve` attaches a verdict: ProfileDiff.facts() and the rest."""
    return {
        "step_time_ratio": 1.5,
        "straggler_cause": cause,
        "straggler_cause_confidence": 0.97,
        "straggler_cause_hardware": cause in ("hardware-compute", "hardware-io"),
        "straggler_cause_where": where,
        "straggler_cause_evidence": [ADDMM, LINEAR],
        "straggler_cause_peer_artifact": PEER_TRACE,
        "artifact": SUSPECT_TRACE,
        "profile_event": "p-1",
        **more,
    }


def straggling(last: dict[str, Any] | None, **envelope: Any) -> Incident:
    """Three straggler reports on one rank, the last one carrying `last` (a verdict, or none)."""
    events = [
        fault_event("straggler", id=f"s{m}", minutes=m, job="llm", rank=2, node="node-b", **envelope)
        for m in (0, 1)
    ]
    events.append(
        fault_event(
            "straggler", id="s2", minutes=2, job="llm", rank=2, node="node-b", attributes=last, **envelope
        )
    )
    return incident(*events, id="inc-slow")


# --- facts ----------------------------------------------------------------------------------------


def test_the_facts_hold_the_verdict_of_the_latest_straggler_that_carries_one() -> None:
    earlier = fault_event("straggler", id="a", minutes=0, attributes=said("software-input", where="loader"))
    later = fault_event("straggler", id="b", minutes=5, attributes=said("hardware-compute"))
    plain = fault_event("straggler", id="c", minutes=9)  # a later report without a verdict changes nothing
    verdict = facts_of(incident(later, plain, earlier)).straggler_verdict
    assert verdict is not None
    assert (verdict.cause, verdict.confidence, verdict.hardware, verdict.where) == (
        Cause.HARDWARE_COMPUTE,
        0.97,
        True,
        "aten::addmm [64x32]",
    )
    assert verdict.evidence[0] == CauseEvidence.model_validate(ADDMM)
    assert (verdict.artifact, verdict.peer_artifact) == (SUSPECT_TRACE, PEER_TRACE)


def test_no_straggler_with_a_verdict_is_no_verdict() -> None:
    assert facts_of(straggling({"step_time_ratio": 1.5})).straggler_verdict is None
    assert facts_of(incident(fault_event("xid"))).straggler_verdict is None


@pytest.mark.parametrize(
    ("attributes", "why"),
    [
        (said("hardware-memory"), "a cause this version does not know"),
        (said("software-input", straggler_cause_confidence="high"), "a confidence that is no number"),
        (said("software-input", straggler_cause_confidence=1.5), "a confidence beyond 1"),
        ({"step_time_ratio": 1.5, "straggler_cause": 3}, "a cause that is no string"),
    ],
)
def test_a_verdict_that_cannot_be_read_is_unknown_never_software(
    attributes: dict[str, Any], why: str
) -> None:
    verdict = facts_of(straggling(attributes)).straggler_verdict
    assert verdict is not None, why
    assert (verdict.cause, verdict.confidence, verdict.hardware) == (Cause.UNKNOWN, 0.0, False), why
    decision = decide(DEFAULT, facts_of(straggling(attributes)))
    assert (decision.rule, decision.action) == ("sustained-straggler", Action.DIAGNOSE), why


def test_a_malformed_evidence_row_is_left_out_and_the_verdict_kept() -> None:
    attributes = said("software-python", straggler_cause_evidence=[{"name": "f"}, "row", ADDMM])
    verdict = facts_of(straggling(attributes)).straggler_verdict
    assert verdict is not None and verdict.cause is Cause.SOFTWARE_PYTHON
    assert [row.name for row in verdict.evidence] == ["aten::addmm [64x32]"]


# --- the policy language ---------------------------------------------------------------------------

RULE = textwrap.dedent(
    """\
    version: 1
    rules:
      - id: soft
        description: slow for the job's own reasons
        override: true
        when:
          straggler: {{}}
          straggler_cause: {causes}
        then: {{classification: software, action: none}}
    """
)


def test_a_rule_naming_causes_matches_only_those_and_never_without_a_verdict() -> None:
    policy = parse_policy(RULE.format(causes="[software-input, unknown]"), "p.yaml")
    assert policy.rules[0].when.straggler_cause == [Cause.SOFTWARE_INPUT, Cause.UNKNOWN]
    rule_of = {
        cause: decide(policy, facts_of(straggling(said(cause)))).rule
        for cause in ("software-input", "unknown", "software-python", "hardware-io")
    }
    assert rule_of == {
        "software-input": "soft",
        "unknown": "soft",
        "software-python": "default",
        "hardware-io": "default",
    }
    assert decide(policy, facts_of(straggling({"step_time_ratio": 1.5}))).rule == "default"


def test_the_decision_says_the_cause_and_where() -> None:
    decision = decide(DEFAULT, facts_of(straggling(said("software-python", where="train.py(88): hot_spot"))))
    assert "straggler cause software-python (confidence 0.97) in train.py(88): hot_spot" in decision.reason


@pytest.mark.parametrize(
    ("causes", "message"),
    [
        (
            "[hardware-gpu]",
            "8:25: rules.0.when.straggler_cause.0: expected 'hardware-compute', 'hardware-io', ",
        ),
        ("[]", "8:24: rules.0.when.straggler_cause: List should have at least 1 item"),
    ],
)
def test_a_bad_cause_fails_policy_check_at_its_line(tmp_path: Path, causes: str, message: str) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text(RULE.format(causes=causes), encoding="utf-8")
    result = CliRunner().invoke(app, ["policy", "check", str(policy)], env={"COLUMNS": "400"})
    assert result.exit_code == 1
    assert result.stderr.startswith(f"{policy}:{message}"), result.stderr
    with pytest.raises(PolicyError):
        load_policy(policy)


# --- the default policy: the node is taken out only for a hardware cause ---------------------------


@pytest.mark.parametrize(
    ("cause", "rule", "action", "classification", "owner"),
    [
        ("hardware-compute", "straggler-hardware-cause", Action.DIAGNOSE, Classification.HARDWARE, None),
        ("hardware-io", "straggler-hardware-cause", Action.DIAGNOSE, Classification.HARDWARE, None),
        ("software-input", "straggler-input-cause", Action.NONE, Classification.SOFTWARE, None),
        ("software-python", "straggler-python-cause", Action.NONE, Classification.SOFTWARE, None),
        (
            "communication",
            "straggler-communication-cause",
            Action.ESCALATE,
            Classification.INFRASTRUCTURE,
            "network",
        ),
        ("none", "sustained-straggler", Action.DIAGNOSE, Classification.HARDWARE, None),
        ("unknown", "sustained-straggler", Action.DIAGNOSE, Classification.HARDWARE, None),
    ],
)
def test_the_default_policy_decides_each_cause(
    cause: str, rule: str, action: Action, classification: Classification, owner: str | None
) -> None:
    decision = decide(DEFAULT, facts_of(straggling(said(cause))))
    assert (decision.rule, decision.action, decision.classification, decision.owner) == (
        rule,
        action,
        classification,
        owner,
    )
    assert decision.diagnose_level == (2 if action is Action.DIAGNOSE else None)
    assert decision.recommend or action is Action.DIAGNOSE  # the owner is told what to look at


def test_without_a_verdict_a_straggler_is_diagnosed_as_before() -> None:
    decision = decide(DEFAULT, facts_of(straggling({"step_time_ratio": 1.5})))
    assert (decision.rule, decision.action, decision.diagnose_level) == (
        "sustained-straggler",
        Action.DIAGNOSE,
        2,
    )


@pytest.mark.parametrize("beside", ["thermal", "dcgm_health", "nccl_timeout", "ecc"])
def test_a_software_verdict_spares_no_node_with_another_fault_beside_it(beside: str) -> None:
    events = [*straggling(said("software-input")).events, fault_event(beside, id="other", node="node-b")]
    decision = decide(DEFAULT, facts_of(incident(*events)))
    assert decision.action is not Action.NONE and decision.classification is not Classification.SOFTWARE


def test_too_few_reports_decide_nothing_whatever_the_verdict() -> None:
    only = fault_event("straggler", id="s", attributes=said("software-input"))
    assert decide(DEFAULT, facts_of(incident(only))).rule == "default"


# --- people: the message and the audit show the verdict and both traces ----------------------------


def test_the_message_text_shows_cause_where_and_the_top_rows() -> None:
    verdict = straggler_verdict(straggling(said("hardware-compute")).events)
    assert verdict is not None
    assert verdict.text() == (
        "Why it is slow: hardware-compute (confidence 0.97) in aten::addmm [64x32]\n"
        "```\n"
        "aten::addmm [64x32] +4.1 ms/step (x1.9)\n"
        "aten::linear [[32,16],[64,16],[64]] +1.2 ms/step (x1.3)\n"
        "```"
    )


def test_both_traces_are_attached_the_straggler_first() -> None:
    assert artifacts_of(straggling(said("software-input")).events) == (
        Artifact("profile of rank 2 on node-b", SUSPECT_TRACE),
        Artifact("profile of a healthy peer, against rank 2 on node-b", PEER_TRACE),
    )


def test_the_audit_shows_the_verdict_as_a_table(sqlite_store: Store) -> None:
    slow = straggling(said("software-python", where="train.py(88): a|b"))
    sqlite_store.record_accepted(slow.events)
    sqlite_store.open_incident(slow)
    detail = sqlite_store.incident_detail(slow.id)
    assert detail is not None
    markdown = incident_markdown(detail)
    assert "## Why the straggler is slow" in markdown
    assert "**software-python** (confidence 0.97) in `train.py(88): a|b`" in markdown
    assert f"Traces: this rank `{SUSPECT_TRACE}`, a healthy peer `{PEER_TRACE}`" in markdown
    assert "| aten::addmm [64x32] | compute | +4.1 | 1.9 |" in markdown
    assert "| aten::linear [[32,16],[64,16],[64]] | compute | +1.2 | 1.3 |" in markdown


def test_an_incident_without_a_verdict_has_no_verdict_section(sqlite_store: Store) -> None:
    plain = straggling({"step_time_ratio": 1.5})
    sqlite_store.record_accepted(plain.events)
    sqlite_store.open_incident(plain)
    detail = sqlite_store.incident_detail(plain.id)
    assert detail is not None and "Why the straggler is slow" not in incident_markdown(detail)
