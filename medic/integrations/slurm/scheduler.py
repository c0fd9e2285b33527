"""A `Scheduler` over a real Slurm cluster, with `Reservations` for sweeps (reservations.py).

Rules that keep GPU Medic from fighting the people who run the cluster:
- `drain` leaves a node that is already out of service alone: one drained by GPU Medic stays as it is
  (the first incident's reason is kept), one drained, failed or down for any other reason raises
  NodeHeldByOthersError and its reason is not touched.
- `resume` returns a node to service only when its reason starts with "medic:"; anything else raises
  ResumeRefusedError. An admin's drain is never undone.
Slurm has no compare-and-set for node state: between our read and our update an admin could still
change the node. The window is one scontrol round trip.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime

from medic.hostlist import expand_hostlist
from medic.integrations.slurm.cli import SlurmCli
from medic.integrations.slurm.errors import (
    NodeHeldByOthersError,
    NotRequeueableError,
    ResumeRefusedError,
    SlurmCommandError,
    SlurmError,
    SlurmUnreachableError,
    UnknownJobError,
    UnknownSlurmNodeError,
)
from medic.integrations.slurm.records import SlurmJob
from medic.integrations.slurm.reservations import SlurmReservations
from medic.integrations.slurm.spares import SlurmSpares
from medic.integrations.slurm.topology import TopologyFormatError
from medic.integrations.slurm.topology import read as read_topology
from medic.protocols import JobInfo, JobState, NodeInfo
from medic.topology import Topology

log = logging.getLogger(__name__)

# What squeue's JSON says of a job that `scontrol requeuehold` put back in the queue held: a hold
# reason, and this description (a plain `scontrol hold` leaves the description empty).
HELD_REASONS = frozenset({"JobHeldUser", "JobHeldAdmin"})
REQUEUED_HELD = "requeued in held state"
RELEASE_TRIES = 3
# squeue's reasons for a job that is eligible to start but finds no nodes it may use: busy ones
# (Resources), unavailable ones, or too few left by its ExcNodeList (BadConstraints).
WAITING_FOR_NODES = ("Resources", "ReqNodeNotAvail", "BadConstraints")
TOPOLOGY_TTL_S = 600.0  # switches change with recabling, not by the minute


class SlurmScheduler(SlurmReservations, SlurmSpares):
    def __init__(self, cli: SlurmCli | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cli = cli or SlurmCli()
        # Jobs this scheduler requeued held and has not seen released: a later requeue of one finds
        # it pending and releases it. Someone else's hold on a pending job is never released.
        self._holding: set[str] = set()
        self._clock = clock
        self._topology = Topology()
        self._topology_until = 0.0

    def nodes(self) -> list[NodeInfo]:
        leaves = self._leaves()
        return sorted(
            (replace(n.info(), switch=leaves.switch_of(n.name)) for n in self.cli.nodes()),
            key=lambda n: n.name,
        )

    def node(self, name: str) -> NodeInfo:
        return replace(self.cli.node(name).info(), switch=self._leaves().switch_of(name))

    def _leaves(self) -> Topology:
        """Each node's leaf switch from `scontrol show topology` (topology/tree), read at most every
        TOPOLOGY_TTL_S; none without a topology plugin (scontrol then prints nothing on stdout)."""
        if self._clock() >= self._topology_until:
            self._topology_until = self._clock() + TOPOLOGY_TTL_S
            try:
                self._topology = read_topology(self.cli)
            except (SlurmError, TopologyFormatError) as error:  # the last one read will do
                log.warning("cannot read Slurm's topology: %s", error)
        return self._topology

    def booted_at(self, name: str) -> datetime | None:
        """slurmd's BootTime: the witness that settles a cloud provider's reboot lost in a crash."""
        return self.cli.booted_at(name)

    def _slurm_job(self, job_id: str) -> SlurmJob | None:
        return next((j for j in self.cli.jobs() if j.id == str(job_id)), None)

    def job(self, job_id: str) -> JobInfo | None:
        job = self._slurm_job(job_id)
        return job.info() if job else None

    def jobs_on_node(self, name: str) -> list[JobInfo]:
        """Jobs that hold the node now (running, or still ending there); finished ones are left out."""
        self.cli.node(name)  # an unknown node is an error, not "no jobs"
        return [j.info() for j in self.cli.jobs() if name in j.nodes and j.job_state is JobState.RUNNING]

    def drain(self, name: str, reason: str) -> None:
        if not reason.strip():
            raise ValueError("a drain needs a reason")
        node = self.cli.node(name)
        if node.held_by_others:
            raise NodeHeldByOthersError(name, node.describe, node.reason, "re-drain")
        if node.out_of_service:
            return  # already out by us: keep the reason naming the incident that took it out
        self.cli.scontrol("update", f"nodename={name}", "state=drain", f"reason={reason}")

    def resume(self, name: str) -> None:
        node = self.cli.node(name)
        info = node.info()
        if not info.drained_by_medic:
            why = (
                f"it is {node.describe} by someone else (reason: {node.reason}); an admin's drain is never undone"
                if node.held_by_others
                else f"it is {node.describe} (reason: {node.reason or 'none'}), not drained by GPU Medic"
            )
            raise ResumeRefusedError(name, why)
        self.cli.scontrol("update", f"nodename={name}", "state=resume")

    def requeue(self, job_id: str, exclude: list[str]) -> JobInfo:
        """Send the job back to the queue, barred from `exclude` (added to any ExcNodeList it had).

        A running job is requeued held, its ExcNodeList set, then released: Slurm's ExcNodeList can
        only change while a job is pending, and the hold keeps it from starting again before the
        exclusion is in place. Slurm starts it again once the old job credential expires
        (AuthInfo cred_expire, 120 s by default). A job that is already pending (Slurm requeued it
        itself, e.g. when a node went down) only gets the exclusion, unless it is one this scheduler
        requeued held and could not release before (a timeout): then it is released too.
        """
        job = self._slurm_job(job_id)
        if job is None:
            raise UnknownJobError(job_id)
        known = {n.name for n in self.cli.nodes()}
        unknown = [n for n in exclude if n not in known]
        if unknown:
            raise UnknownSlurmNodeError(", ".join(unknown))
        excluded = ",".join(filter(None, [job.excluded, *exclude]))
        if job.job_state is JobState.RUNNING:
            self._requeue_held(job.id)
        elif job.job_state is not JobState.PENDING:
            raise NotRequeueableError(job_id, f"it has ended ({job.state})")
        if job.id in self._holding:
            try:
                if exclude:
                    self._exclude(job_id, excluded)
            finally:
                # Never leave the job held: without the exclusion it still runs, off our drained node.
                self._release(job.id)
        elif exclude:
            self._exclude(job_id, excluded)
        after = self.job(job_id)
        if after is None:
            raise UnknownJobError(job_id)
        return after

    def readmit(self, job_id: str, node: str) -> bool:
        """Take `node` out of the ExcNodeList of a job that waits for nodes (WAITING_FOR_NODES); the
        other nodes it bars stay barred. A job that waits for anything else
        (its begin time after a requeue, a hold), whose reason Slurm does not give, or that runs or
        ended, is left alone: it may yet start elsewhere."""
        job = self._slurm_job(job_id)
        if (
            job is None
            or job.job_state is not JobState.PENDING
            or not job.reason.startswith(WAITING_FOR_NODES)
        ):
            return False
        barred = expand_hostlist(job.excluded)
        if node not in barred:
            return False
        # An empty ExcNodeList clears it: the job may use any node again.
        self._exclude(job_id, ",".join(n for n in barred if n != node))
        return True

    def _requeue_held(self, job_id: str) -> None:
        # Marked before the call, and kept after a timeout: the requeuehold may have taken effect
        # (or take effect late), and the next requeue of a job marked here releases it if pending.
        self._holding.add(job_id)
        try:
            self.cli.scontrol("requeuehold", job_id)
        except SlurmUnreachableError:
            # No answer is not a refusal: slurmctld may have requeued the job held and only the reply
            # was lost. Then nothing but our release starts it again, so read it back and go on to the
            # release when it sits held by that requeue; still running, the error stands.
            if not self._requeued_held(job_id):
                raise
        except SlurmCommandError as error:
            self._holding.discard(job_id)  # refused: nothing was held
            if "presently disabled" in error.detail:
                raise NotRequeueableError(
                    job_id, "it does not allow requeues (submitted with --no-requeue, or JobRequeue=0)"
                ) from error
            raise

    def _release(self, job_id: str) -> None:
        """Release a job we requeued held. A release that times out is asked again while the job still
        reads held (releasing sets a state, and releasing a job that is not held is a no-op)."""
        for attempt in range(1, RELEASE_TRIES + 1):
            try:
                self.cli.scontrol("release", job_id)
            except SlurmUnreachableError:
                if self._requeued_held(job_id):
                    if attempt < RELEASE_TRIES:
                        continue
                    raise  # it stays in `_holding`: the next requeue of the job releases it
            self._holding.discard(job_id)
            return

    def _requeued_held(self, job_id: str) -> bool:
        """Whether the job waits held by a `requeuehold`, read from squeue's JSON (SlurmJob keeps
        neither field: nothing else needs them)."""
        doc = self.cli._json("squeue", "--json")
        raw = next((j for j in doc.get("jobs") or [] if str(j.get("job_id")) == job_id), None)
        return (
            raw is not None
            and raw.get("state_reason") in HELD_REASONS
            and REQUEUED_HELD in str(raw.get("state_description") or "")
        )

    def _exclude(self, job_id: str, hostlist: str) -> None:
        try:
            self.cli.scontrol("update", f"jobid={job_id}", f"ExcNodeList={hostlist}")
        except SlurmCommandError as error:
            raise SlurmError(f"job {job_id}: could not exclude {hostlist}: {error.detail}") from error
