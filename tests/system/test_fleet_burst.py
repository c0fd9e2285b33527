"""Burst (a) of issue 40 at a size the test machine allows: fatal XIDs on 6 nodes and non-fatal ones
on 54 others of a 300-node simulated fleet, within seconds, through two `medic serve` replicas on one
PostgreSQL store and a Prefect server (bench/fleet_burst.py, whose full-size figures are in
BENCHMARKS.md, "At fleet scale"). Nothing acknowledged is lost, and exactly the fatal nodes are
drained: none of the others, none missed."""

from __future__ import annotations

import pytest

from bench.fleet_burst import run

pytestmark = pytest.mark.system


def test_a_burst_drains_exactly_the_fatal_nodes_and_loses_no_event() -> None:
    result = run(nodes=300, fatal=6, nonfatal=54, replicas=2)
    assert result["stored"] == result["acknowledged"] == 60
    assert (result["wrongly_drained"], result["missed"]) == ([], [])
    assert result["drained"] == 6 and result["to_exact_s"] is not None
    assert result["incidents"] == 60  # one per struck node, whichever replica took its event
