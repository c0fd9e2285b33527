"""The `gpu_incidents` condition: the same GPU in incident after incident, across jobs, acted on.

Its facts come from where each path keeps a node's history: `medic triage` (and so `policy test`)
from the incidents it decided before, the flows from the store, `policy replay` from the facts
recorded with each decision.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from checkout import REPO_ROOT
from factories import fault_event

from medic.ageing import PastIncident
from medic.facts import facts_of
from medic.incidents import Incident, correlate
from medic.policy import LoadedPolicy, PolicyError, decide, load_policy
from medic.policy.loader import parse_policy
from medic.tasks.nodes.evidence import evaluate
from medic.tasks.runtime.process import Runtime
from medic.triage import triage
from medic.whatif.replay import FactsRecord, facts_from, record_facts
from medic.whatif.testing import default_tests_path, load_tests, run_tests

EXAMPLE = REPO_ROOT / "policies" / "examples" / "replace-ageing-gpu.yaml"
AGEING = """
version: 1
rules:
  - id: application-fault
    description: the job's own fault
    when: {kinds: [nan_loss]}
    then: {classification: software, action: none}
  - id: ageing-gpu
    description: the GPU is wearing out
    when:
      gpu_incidents: {at_least: 3, within_days: 14, distinct_jobs_at_least: 2}
    then: {classification: hardware, action: replace}
"""


def loaded(text: str = AGEING) -> LoadedPolicy:
    return LoadedPolicy(parse_policy(text, "ageing.yaml"), "ageing.yaml", "0" * 64)


def xid(day: float, job: str, gpu: int = 3, node: str = "n1", kind: str = "xid") -> object:
    attributes = {"code": 79} if kind == "xid" else {}
    return fault_event(kind, node=node, gpu=gpu, job=job, minutes=day * 1440, attributes=attributes)


def test_the_example_policys_own_cases_pass() -> None:
    example = load_policy(EXAMPLE)
    results = run_tests(example, load_tests(default_tests_path(EXAMPLE)))
    assert [r.differences for r in results if not r.passed] == []
    assert example.policy.approvals.required_for == ["replace"]


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("{at_least: 3, within_days: 366}", "less than or equal to 365"),
        ("{at_least: 0}", "greater than 0"),
        ("{within_days: 14}", "at_least"),
        ("{at_least: 3, distinct_jobs: 2}", "distinct_jobs"),
    ],
)
def test_a_bad_condition_is_refused(field: str, message: str) -> None:
    text = AGEING.replace("{at_least: 3, within_days: 14, distinct_jobs_at_least: 2}", field)
    with pytest.raises(PolicyError, match=message):
        loaded(text)


def test_triage_counts_earlier_incidents_on_the_same_gpu_across_jobs() -> None:
    events = [xid(0, "j1"), xid(3, "j2"), xid(6, "j2")]
    decisions = [d for _, d in triage(events, loaded())]
    assert [d.action.value for d in decisions] == ["none", "none", "replace"]
    assert decisions[-1].reason == (
        "the GPU is wearing out: 3 incidents on GPU 3 within 14 days across 2 jobs (j1, j2)"
    )


def test_incidents_the_policy_blamed_on_the_application_do_not_count() -> None:
    events = [xid(0, "j1", kind="nan_loss"), xid(3, "j2", kind="nan_loss"), xid(6, "j3")]
    assert [d.rule for _, d in triage(events, loaded())] == [
        "application-fault",
        "application-fault",
        "default",
    ]


def test_the_history_rides_with_the_decisions_facts_into_replay() -> None:
    incidents = correlate([xid(0, "j1"), xid(3, "j2"), xid(6, "j3")])
    history = tuple(PastIncident.of(i, "hardware") for i in incidents[:2])
    facts = facts_of(incidents[2], gpu_history=history)
    record = FactsRecord.model_validate_json(FactsRecord(**record_facts(facts)).model_dump_json())
    again = facts_from(record, {e.id: e for e in incidents[2].events}, facts.context)
    assert again.gpu_history == history
    policy = loaded().policy
    assert decide(policy, again).action.value == decide(policy, facts).action.value == "replace"
    # A decision recorded before the history was kept reads as one without it.
    old = {k: v for k, v in record_facts(facts).items() if k != "gpu_history"}
    assert FactsRecord.model_validate(old).gpu_history == ()


def _stored(runtime: Runtime, incident: Incident, classification: str) -> None:
    runtime.store.record_events([incident])
    runtime.store.open_incident(incident)
    runtime.store.update_incident(incident.id, status="closed", classification=classification)


def test_the_flows_read_the_nodes_earlier_incidents_from_the_store(runtime: Runtime) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    at = [now - timedelta(days=d) for d in (20, 9, 4, 0)]
    old, first, second, current = (
        correlate([fault_event(node="gpu-node-1", gpu=3, job=job, at=t)])[0]
        for t, job in zip(at, ("j0", "j1", "j2", "j2"), strict=True)
    )
    for incident in (old, first, second):
        _stored(runtime, incident, "hardware")
    runtime.store.record_events([current])
    runtime.store.open_incident(current)
    runtime.policy_path = EXAMPLE
    decision = evaluate(runtime, current.id)
    assert (decision.rule, decision.action.value, decision.approve) == ("ageing-gpu-replace", "replace", True)
    assert "3 incidents on GPU 3 within 14 days across 2 jobs (j1, j2)" in decision.reason
    recorded = runtime.store.incident_detail(current.id)
    assert recorded is not None
    kept = recorded.decisions[-1].facts
    assert kept is not None and [p["id"] for p in kept["gpu_history"]] == [first.id, second.id]
