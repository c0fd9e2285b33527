"""A `Scheduler` over a real Slurm cluster.

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

from integrations.slurm.cli import SlurmCli
from integrations.slurm.errors import (
    NodeHeldByOthersError,
    NotRequeueableError,
    ResumeRefusedError,
    SlurmCommandError,
    SlurmError,
    UnknownJobError,
    UnknownSlurmNodeError,
)
from integrations.slurm.records import SlurmJob
from medic.protocols import JobInfo, JobState, NodeInfo


class SlurmScheduler:
    def __init__(self, cli: SlurmCli | None = None) -> None:
        self.cli = cli or SlurmCli()

    def nodes(self) -> list[NodeInfo]:
        return sorted((n.info() for n in self.cli.nodes()), key=lambda n: n.name)

    def node(self, name: str) -> NodeInfo:
        return self.cli.node(name).info()

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
        itself, e.g. when a node went down) only gets the exclusion.
        """
        job = self._slurm_job(job_id)
        if job is None:
            raise UnknownJobError(job_id)
        known = {n.name for n in self.cli.nodes()}
        unknown = [n for n in exclude if n not in known]
        if unknown:
            raise UnknownSlurmNodeError(", ".join(unknown))
        excluded = ",".join(filter(None, [job.excluded, *exclude]))
        state = job.job_state
        if state is JobState.PENDING:
            if exclude:
                self._exclude(job_id, excluded)
        elif state is JobState.RUNNING:
            try:
                self.cli.scontrol("requeuehold", job.id)
            except SlurmCommandError as error:
                if "presently disabled" in error.detail:
                    raise NotRequeueableError(
                        job_id, "it does not allow requeues (submitted with --no-requeue, or JobRequeue=0)"
                    ) from error
                raise
            try:
                if exclude:
                    self._exclude(job_id, excluded)
            finally:
                # Never leave the job held: without the exclusion it still runs, off our drained node.
                self.cli.scontrol("release", job.id)
        else:
            raise NotRequeueableError(job_id, f"it has ended ({job.state})")
        after = self.job(job_id)
        if after is None:
            raise UnknownJobError(job_id)
        return after

    def _exclude(self, job_id: str, hostlist: str) -> None:
        try:
            self.cli.scontrol("update", f"jobid={job_id}", f"ExcNodeList={hostlist}")
        except SlurmCommandError as error:
            raise SlurmError(f"job {job_id}: could not exclude {hostlist}: {error.detail}") from error
