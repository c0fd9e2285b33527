"""Resume the job: restart it from its last complete checkpoint, away from the bad node."""

from __future__ import annotations

import time

from prefect import task
from pydantic import BaseModel

from medic.protocols import JobInfo, JobState
from medic.store import utcnow
from tasks.retry import transient_only
from tasks.runtime import Runtime, current
from tasks.stage import stage


class ResumeOutcome(BaseModel):
    job: str
    checkpoint_step: int | None
    resumed_step: int | None  # None: the job runs again but has reported no step yet
    lost_seconds: float | None  # work since the checkpoint, to be redone
    seconds_to_resume: float
    nodes: list[str]

    def describe(self) -> str:
        if self.checkpoint_step is None:
            return f"job {self.job} restarted from scratch: no complete checkpoint was found"
        now = f" (now at step {self.resumed_step})" if self.resumed_step is not None else ""
        lost = f"; work lost ≈ {self.lost_seconds:.0f} s" if self.lost_seconds is not None else ""
        return f"job {self.job} resumed from step {self.checkpoint_step}{now}{lost}"


def _checkpoint_step(rt: Runtime, job: str) -> int | None:
    latest = rt.backends.checkpoints.latest(job)
    return latest.step if latest else None


def _progressed(rt: Runtime, job: str, info: JobInfo, floor: int) -> bool:
    if info.step is not None and info.step > floor:
        return True  # it trained past its checkpoint: resumed (a later failure is a new fault)
    if info.state is JobState.COMPLETED:
        return True  # finished between two polls, or had nothing left to train
    if info.state is JobState.FAILED and info.restarts > 0:
        raise RuntimeError(f"job {job} failed again after its restart, before passing step {floor}")
    if info.state is not JobState.RUNNING or info.step is not None:
        return False
    return (_checkpoint_step(rt, job) or 0) > floor or info.restarts > 0


@task(
    name="resume job",
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=transient_only,
    timeout_seconds=1800,
)
def resume_job(incident_id: str, job: str, exclude: list[str], wait_s: float = 900) -> ResumeOutcome:
    rt = current()
    with stage(rt.store, incident_id, "resume job") as log:
        started = time.monotonic()
        checkpoint = rt.backends.checkpoints.latest(job)
        info = rt.backends.scheduler.requeue(job, exclude)
        floor = checkpoint.step if checkpoint else 0
        # Done when the job trains past its checkpoint, not when the scheduler says "running".
        # A scheduler that knows no training steps (Slurm) can only tell that the requeued job
        # runs again; then a newer checkpoint is the proof of progress we wait for, if any.
        delay = 0.05
        while not _progressed(rt, job, info, floor):
            if time.monotonic() - started > wait_s:
                raise TimeoutError(f"job {job} did not pass step {floor} within {wait_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            latest = rt.backends.scheduler.job(job)
            if latest is None:
                raise LookupError(f"job {job} vanished after requeue")
            info = latest
        outcome = ResumeOutcome(
            job=job,
            checkpoint_step=checkpoint.step if checkpoint else None,
            resumed_step=info.step if info.step is not None else _checkpoint_step(rt, job),
            lost_seconds=(utcnow() - checkpoint.saved_at).total_seconds() if checkpoint else None,
            seconds_to_resume=time.monotonic() - started,
            nodes=list(info.nodes),
        )
        log.done(f"{outcome.describe()} on {', '.join(outcome.nodes)}", **outcome.model_dump())
        return outcome
