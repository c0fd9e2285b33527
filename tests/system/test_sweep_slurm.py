"""Sweeps against the real Slurm cluster of tests/system/test_slurm.py (scripts/slurm-cluster.sh): the
reservation is there, MAINT, while the check runs and keeps a job off the node; it is gone afterwards,
also when the check raises; a node with a job is never reserved; the guardrails cap what is held."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest
from slurm_cluster import NODES, Cluster, cluster, slurm  # noqa: F401  (the cluster fixtures, reused)

from medic.flows.sweep import sweep
from medic.integrations import registry
from medic.integrations.slurm import SlurmCli, SlurmScheduler
from medic.protocols import DiagnosticResult, JobState
from medic.store import Store
from medic.sweep import RESERVATION_PREFIX, NodeBusyError, SweepSettings
from medic.tasks.runtime.process import Runtime, configure
from medic.tasks.sweep import sweep_node

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("prefect_harness")]

POLICY = """\
version: 1
guardrails: {max_out_of_service: 2}
rules:
  - id: diag-fail-drain
    description: A DCGM diagnostic failed; keep jobs off the node
    when:
      diagnostic: {result: fail}
    then: {classification: hardware, action: drain}
"""


@dataclass
class Seen:
    node: str
    reservation: str  # scontrol's line for the sweep's reservation holding the node, "" if none
    held: frozenset[str]  # every node our sweeps held at that moment
    out_of_service: frozenset[str]  # every node drained or down at that moment
    job_kept_off: bool | None = None  # a job asked for the node during the check stayed pending


@dataclass
class WatchingDiagnostics:
    """A `Diagnostics` that looks at Slurm while it "runs": what the tests assert on."""

    slurm: Cluster
    fail: set[str] = field(default_factory=set)
    try_a_job: set[str] = field(default_factory=set)  # ask for these nodes with a job mid-check
    seen: list[Seen] = field(default_factory=list)

    def run(self, node: str, level: int, timeout_s: float) -> DiagnosticResult:
        started = datetime.now(UTC)
        lines = self.slurm.cli.scontrol("-o", "show", "reservation").splitlines()
        mine = [
            ln for ln in lines if f"ReservationName={RESERVATION_PREFIX}" in ln and f"Nodes={node} " in ln
        ]
        seen = Seen(
            node,
            mine[0] if mine else "",
            SlurmScheduler(self.slurm.cli).reserved_nodes(),
            frozenset(n.name for n in self.slurm.cli.nodes() if n.info().out_of_service),
        )
        if node in self.try_a_job:
            job = self.slurm.sbatch("--nodes=1", f"--nodelist={node}")
            time.sleep(3)  # the backfill and main schedulers both get a turn
            state = next(j for j in self.slurm.cli.jobs() if j.id == job).job_state
            seen.job_kept_off = state is JobState.PENDING
        self.seen.append(seen)
        result = "fail" if node in self.fail else "pass"
        return DiagnosticResult(node, level, result, (), f"watched: {result}", started, datetime.now(UTC))


class Exploding:
    def run(self, node: str, level: int, timeout_s: float) -> DiagnosticResult:
        raise RuntimeError("dcgmi fell over")


@pytest.fixture
def watching(slurm: Cluster) -> Iterator[WatchingDiagnostics]:  # noqa: F811
    yield WatchingDiagnostics(slurm)
    leftover = [ln for ln in _reservations(slurm) if RESERVATION_PREFIX in ln]
    for line in leftover:  # never leave a reservation to the tests after this one
        name = line.split()[0].removeprefix("ReservationName=")
        slurm.run("scontrol", "delete", f"ReservationName={name}")
    assert not leftover, leftover


@pytest.fixture
def rt(sqlite_store: Store, watching: WatchingDiagnostics, tmp_path: Path) -> Runtime:
    policy = tmp_path / "sweep.yaml"
    policy.write_text(POLICY)
    backends, _ = registry.simulated()
    backends.scheduler = SlurmScheduler()
    backends.diagnostics = watching
    return configure(Runtime(sqlite_store, backends, policy))


def _reservations(on: Cluster) -> list[str]:
    out = on.run("scontrol", "-o", "show", "reservation")
    return [] if out.startswith("No reservations") else out.splitlines()


def test_the_reservation_holds_during_the_check_and_is_gone_after(
    slurm: Cluster,  # noqa: F811
    rt: Runtime,
    watching: WatchingDiagnostics,
) -> None:
    # The failing node goes to remediation, which drains it: the job is tried on the other one.
    watching.try_a_job = {NODES[1]}
    watching.fail = {NODES[0]}
    report = asyncio.run(sweep(SweepSettings(max_nodes=2)))

    assert [n.node for n in report.nodes] == NODES[:2]  # never checked: by name
    for seen in watching.seen:
        assert seen.reservation, f"{seen.node} was not held while its check ran"
        assert "Flags=MAINT" in seen.reservation and "State=ACTIVE" in seen.reservation
    assert [s.job_kept_off for s in watching.seen if s.node == NODES[1]] == [True]  # no job mid-check
    assert _reservations(slurm) == []  # released, both
    assert {n.result for n in report.nodes} == {"fail", "pass"}
    (handed,) = report.handed_on
    assert (handed.node, handed.action) == (NODES[0], "drain")
    assert SlurmScheduler().node(NODES[0]).drained_by_medic


def test_a_check_that_raises_still_releases(slurm: Cluster, rt: Runtime) -> None:  # noqa: F811
    rt.backends.diagnostics = Exploding()
    with pytest.raises(RuntimeError, match="dcgmi fell over"):
        asyncio.run(sweep(SweepSettings(max_nodes=2)))
    assert _reservations(slurm) == []


def test_a_node_with_a_job_is_never_reserved(
    slurm: Cluster,  # noqa: F811
    rt: Runtime,
    watching: WatchingDiagnostics,
) -> None:
    busy = slurm.running(slurm.sbatch("--nodes=1", f"--nodelist={NODES[0]}")).nodes[0]
    report = asyncio.run(sweep(SweepSettings(max_nodes=4)))
    assert busy not in [n.node for n in report.nodes]
    assert next(s.why for s in report.plan.skipped if s.node == busy).startswith("allocated")
    # A job that lands between the plan and the reservation: Slurm itself refuses, the sweep skips it.
    with pytest.raises(NodeBusyError, match=busy):
        SlurmScheduler().reserve([busy], 20, "test")
    skipped = sweep_node.fn("sweep-test", busy, 2, 20)
    assert skipped.result == "busy"
    # The three idle ones were due; max_out_of_service 2 let two be held.
    assert sorted(s.node for s in watching.seen) == [n for n in NODES if n != busy][:2]  # checked at once


def test_the_guardrails_cap_what_a_sweep_holds(
    slurm: Cluster,  # noqa: F811
    rt: Runtime,
    watching: WatchingDiagnostics,
) -> None:
    slurm.run("scontrol", "update", f"nodename={NODES[3]}", "state=drain", "reason=admin: cabling")
    report = asyncio.run(sweep(SweepSettings(max_nodes=4)))
    # max_out_of_service 2, one node drained by an admin: room for one held node, never more.
    assert [n.node for n in report.nodes] == [NODES[0]]
    assert "guardrail max_out_of_service" in next(s.why for s in report.plan.skipped if s.node == NODES[1])
    for seen in watching.seen:
        assert len(seen.held | seen.out_of_service) <= 2
    # Another sweep's reservation counts at the last check, under the slot, as a drain would.
    other = SlurmScheduler().reserve([NODES[2]], 20, "another sweep")
    try:
        stopped = sweep_node.fn("sweep-test", NODES[1], 2, 20)
    finally:
        SlurmScheduler().release(other)
    assert stopped.result == "stopped" and "max_out_of_service" in stopped.detail
    assert _reservations(slurm) == []
    assert SlurmCli().node(NODES[1]).info().out_of_service is False
