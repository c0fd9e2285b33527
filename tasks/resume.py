"""Resume the job: restart it from its last complete checkpoint, away from the bad node."""

from __future__ import annotations

import time

from prefect import task
from pydantic import BaseModel

from medic.store import utcnow
from tasks.runtime import current
from tasks.stage import stage


class ResumeOutcome(BaseModel):
    job: str
    checkpoint_step: int | None
    resumed_step: int
    lost_seconds: float | None  # work since the checkpoint, to be redone
    seconds_to_resume: float
    nodes: list[str]


@task(name="resume job", retries=1, retry_delay_seconds=2, timeout_seconds=1800)
def resume_job(incident_id: str, job: str, exclude: list[str], wait_s: float = 900) -> ResumeOutcome:
    rt = current()
    with stage(rt.store, incident_id, "resume job") as log:
        started = time.monotonic()
        checkpoint = rt.backends.checkpoints.latest(job)
        info = rt.backends.scheduler.requeue(job, exclude)
        floor = checkpoint.step if checkpoint else 0
        # Done when the job trains past its checkpoint, not when the scheduler says "running".
        delay = 0.05
        while (info.step or 0) <= floor:
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
            resumed_step=info.step or 0,
            lost_seconds=(utcnow() - checkpoint.saved_at).total_seconds() if checkpoint else None,
            seconds_to_resume=time.monotonic() - started,
            nodes=list(info.nodes),
        )
        log.done(
            f"job {job} resumed from step {outcome.checkpoint_step} on {', '.join(outcome.nodes)}; "
            f"now at step {outcome.resumed_step}",
            **outcome.model_dump(),
        )
        return outcome
