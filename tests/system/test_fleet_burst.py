"""The bursts of issue 40 at a size the test machine allows, through two `medic serve` replicas on
one PostgreSQL store and a Prefect server (tests/bench/fleet_burst.py, whose full-size figures are in
BENCHMARKS.md, "At fleet scale"):

- (a) fatal XIDs on 6 nodes and non-fatal ones on 54 others of a 300-node fleet: nothing
  acknowledged is lost, and exactly the fatal nodes are drained;
- (b) fatal XIDs on 40 nodes, more than the guardrails let out: at most as many out at once as the
  limit that binds allows between the two replicas, and exactly that many; a breaker that opens
  stays open;
- (c) every node under 4 switches reports a collective timeout, the events of each switch split
  between the replicas: one switch-wide incident per switch, no node touched."""

from __future__ import annotations

import pytest
from bench.fleet_burst import run, run_fatal, run_storm

pytestmark = pytest.mark.system


def test_a_burst_drains_exactly_the_fatal_nodes_and_loses_no_event() -> None:
    result = run(nodes=300, fatal=6, nonfatal=54, replicas=2)
    assert result["stored"] == result["acknowledged"] == 60
    assert (result["wrongly_drained"], result["missed"]) == ([], [])
    assert result["drained"] == 6 and result["to_exact_s"] is not None
    assert result["incidents"] == 60  # one per struck node, whichever replica took its event


@pytest.mark.parametrize(
    ("breaker_percent", "allowed", "guardrail"),
    [(25, 30, "max_out_of_service"), (5, 15, "circuit_breaker")],
    ids=["out-of-service-limit", "breaker"],
)
def test_a_fatal_burst_over_the_limits_takes_out_exactly_what_they_allow(
    breaker_percent: float, allowed: int, guardrail: str
) -> None:
    result = run_fatal(nodes=300, fatal=40, breaker_percent=breaker_percent, replicas=2)
    assert result["stored"] == result["acknowledged"] == 40
    assert result["all_decided_s"] is not None  # every incident decided: no drain can still come
    # The level is reached, never passed, between the two replicas (drains counted, not returns:
    # bench.fleet_burst.out_over_time); only fatal nodes go out.
    assert (result["allowed"], result["peak_out"], result["wrongly_drained"]) == (allowed, allowed, [])
    assert result["stopped_by_guardrail"].get(guardrail, 0) > 0  # named in the decisions it stopped
    if guardrail == "circuit_breaker":  # it opens at its level and holds: nothing drained after it
        assert result["drained"] == allowed
        assert result["breaker"] is not None and result["drains_after_breaker"] == 0
    else:
        assert result["breaker"] is None


def test_a_switch_tier_storm_is_one_incident_per_switch_and_touches_no_node() -> None:
    result = run_storm(nodes=300, switches=4, replicas=2)
    assert result["stored"] == result["acknowledged"] == 64
    assert result["switch_incidents"] == result["switches_with_one_incident"] == 4
    assert (result["node_incidents"], result["node_actions"]) == ({}, 0)
    assert result["all_decided_s"] is not None
