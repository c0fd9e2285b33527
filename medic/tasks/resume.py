"""Moving jobs off a bad node and resuming them: requeued away from the node, restarted from their
last complete checkpoint (docs/decisions/0008-job-off-node.md).

Nothing stresses or resets a node while a job still runs on it: the drain before a DCGM level 2-4
run and a destructive action first call `move_jobs_off`, which requeues each job running there once
per incident (a `requeue` action and a `move job off` step in the store). After the act,
`resume_job` requeues a job this incident has not moved yet; one it moved already is only waited on
until it trains past its checkpoint, never requeued a second time.

A job named hung before its collectives time out, on nodes that stay in service, is requeued where it
is by `restart_hung_job`: nothing else would end the hang before PyTorch's watchdog (10 minutes by
default). One hang opens an incident on each of its nodes; the first to claim the restart does it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from prefect import task
from pydantic import BaseModel

from medic.errors import is_transient
from medic.protocols import JobInfo, JobState
from medic.statuses import ActionStatus, StepStatus
from medic.store import utcnow
from medic.store.tables import ActionRecord
from medic.tasks.nodes.service import returned
from medic.tasks.nodes.spares import lend_spare
from medic.tasks.runtime.process import Runtime, current
from medic.tasks.runtime.retry import transient_only
from medic.tasks.runtime.stage import StageLog, stage

MOVE_STAGE = "move job off"
REQUEUE = "requeue"  # the action's name in the store
RESTART = "restart"  # ... a hung job's requeue onto the nodes it has
# How long a requeued job may take to leave the node: Slurm ends its processes there first (KillWait).
MOVE_WAIT_S = 120.0
RESUME_POLL_S = 5.0  # the longest wait between two looks at a requeued job
READMIT_POLL_S = 1.0  # ... once the node it was barred from is back in service


class ResumeOutcome(BaseModel):
    job: str
    checkpoint_step: int | None
    resumed_step: int | None  # None: the job runs again but has reported no step yet
    lost_seconds: float | None  # work since the checkpoint, to be redone
    seconds_to_resume: float
    nodes: list[str]
    spare: str = ""  # what the spare pool gave for its requeue (docs/spares.md)
    readmitted: str = ""  # the repaired node it was let back on, with nowhere else to go (docs/recovery.md)

    def describe(self) -> str:
        waited = (
            f"it waited for {self.readmitted}, repaired, with no other node free" if self.readmitted else ""
        )
        tail = "".join(f"; {part}" for part in (self.spare, waited) if part)
        if self.checkpoint_step is None:
            return f"job {self.job} restarted from scratch: no complete checkpoint was found{tail}"
        now = f" (now at step {self.resumed_step})" if self.resumed_step is not None else ""
        lost = f"; work lost ≈ {self.lost_seconds:.0f} s" if self.lost_seconds is not None else ""
        return f"job {self.job} resumed from step {self.checkpoint_step}{now}{lost}{tail}"


class Restart(BaseModel):
    """One requeue: the checkpoint the job restarts from and the work since it, as of the request."""

    checkpoint_step: int | None
    lost_seconds: float | None
    requeued_at: datetime
    spare: str = ""  # what the spare pool gave for it

    def describe(self) -> str:
        step = f" from checkpoint step {self.checkpoint_step}" if self.checkpoint_step is not None else ""
        return f"{step}; {self.spare}" if self.spare else step


@dataclass(frozen=True, slots=True)
class JobsOff:
    """What `move_jobs_off` did. `stuck` says why a job still runs on the node: then nothing that
    stresses or resets the node may run there, and the incident escalates."""

    detail: str = ""
    stuck: str | None = None


def move_key(incident_id: str, node: str, job: str) -> str:
    return f"{incident_id}:{node}:{REQUEUE}:{job}"


def move_jobs_off(rt: Runtime, incident_id: str, node: str) -> JobsOff:
    """Requeue every job running on the (drained) node away from it, and wait until none runs there.

    A `TransientError` propagates for the calling task to retry; a job this incident moved already is
    not requeued again. Any other failure stops at that job and says why in `stuck`."""
    running = [j.id for j in rt.backends.scheduler.jobs_on_node(node) if j.state is JobState.RUNNING]
    moved: list[str] = []
    for job in running:
        off = _move_off(rt, incident_id, node, job)
        moved.append(off.detail)
        if off.stuck:
            return JobsOff("; ".join(moved), off.stuck)
    return JobsOff("; ".join(moved))


def _move_off(rt: Runtime, incident_id: str, node: str, job: str) -> JobsOff:
    with stage(rt.store, incident_id, MOVE_STAGE) as log:
        log.detail.update(job=job, node=node)
        key = move_key(incident_id, node, job)
        row, claimed = rt.store.claim_action(key, incident_id, node, REQUEUE)
        if claimed:
            stuck = _requeue_claimed(rt, incident_id, key, job, node, log)
        elif row.status != ActionStatus.SUCCEEDED:
            stuck = (
                f"another requeue of job {job} for this incident has not reported back ({row.status}); "
                "not repeating it blind"
            )
        else:
            stuck = None  # requeued earlier in this incident: only its leaving is waited for
        stuck = stuck or _wait_off(rt, job, node)
        summary = stuck or f"job {job} requeued off {node}"
        log.done(summary, status=StepStatus.FAILED if stuck else StepStatus.OK)
        return JobsOff(summary, stuck)


def _requeue_claimed(
    rt: Runtime, incident_id: str, key: str, job: str, node: str, log: StageLog
) -> str | None:
    """Requeue under the claim `key`; None when done, else why the job could not be moved."""
    try:
        restart, _ = _requeue(rt, incident_id, job, [node])
    except Exception as error:
        rt.store.finish_action(key, ActionStatus.FAILED, f"{type(error).__name__}: {error}")
        if is_transient(error):
            raise
        return f"job {job} could not be moved off {node}: {error}"
    # Before the wait, so the step keeps it even if the wait raises: resume_job reads it back.
    log.detail.update(restart.model_dump(mode="json"))
    rt.store.finish_action(key, ActionStatus.SUCCEEDED, f"job {job} requeued off {node}{restart.describe()}")
    return None


def _requeue(rt: Runtime, incident_id: str, job: str, exclude: list[str]) -> tuple[Restart, JobInfo]:
    checkpoint = rt.backends.checkpoints.latest(job)
    # The job needs a node now, not after the repair: a spare is freed for it first (docs/spares.md).
    spare = lend_spare(rt, incident_id, exclude[0]) if exclude else ""
    asked = utcnow()
    info = rt.backends.scheduler.requeue(job, exclude)
    restart = Restart(
        checkpoint_step=checkpoint.step if checkpoint else None,
        lost_seconds=(asked - checkpoint.saved_at).total_seconds() if checkpoint else None,
        requeued_at=asked,
        spare=spare,
    )
    return restart, info


def _wait_off(rt: Runtime, job: str, node: str) -> str | None:
    """None once the job no longer runs on the node; why not, after MOVE_WAIT_S."""
    deadline = time.monotonic() + MOVE_WAIT_S
    delay = 0.05
    while _runs_on(rt, job, node):
        if time.monotonic() > deadline:
            return f"job {job} still runs on {node} {MOVE_WAIT_S:.0f} s after its requeue"
        time.sleep(delay)
        delay = min(delay * 2, 2.0)
    return None


def _runs_on(rt: Runtime, job: str, node: str) -> bool:
    info = rt.backends.scheduler.job(job)
    return info is not None and info.state is JobState.RUNNING and node in info.nodes


def moved_jobs(rt: Runtime, incident_id: str) -> list[str]:
    """The jobs this incident requeued off its node (before a diagnostic or an action), in that order."""
    detail = rt.store.incident_detail(incident_id)
    actions = detail.actions if detail else []
    jobs = [
        a.key.removeprefix(move_key(incident_id, a.node, ""))
        for a in actions
        if a.action == REQUEUE and a.status == ActionStatus.SUCCEEDED
    ]
    return list(dict.fromkeys(jobs))


def _moved_before(rt: Runtime, incident_id: str, job: str, exclude: list[str]) -> Restart | None:
    """The requeue that moved the job off one of `exclude` earlier in this incident, if there was one."""
    rows = [rt.store.get_action(move_key(incident_id, node, job)) for node in exclude]
    done = [r for r in rows if r is not None and r.status == ActionStatus.SUCCEEDED]
    if not done:
        return None
    detail = rt.store.incident_detail(incident_id)
    moves = [
        s.detail
        for s in (detail.steps if detail else [])
        if s.stage == MOVE_STAGE and s.detail and s.detail.get("job") == job and "requeued_at" in s.detail
    ]
    return Restart.model_validate(moves[-1]) if moves else _restart_unrecorded(rt, job, done[-1])


def _restart_unrecorded(rt: Runtime, job: str, row: ActionRecord) -> Restart:
    # The process died between the requeue's outcome and its step: the newest checkpoint is the best
    # guess at where it restarted; the lost work is not known.
    return Restart(checkpoint_step=_checkpoint_step(rt, job), lost_seconds=None, requeued_at=row.intent_at)


def _checkpoint_step(rt: Runtime, job: str) -> int | None:
    latest = rt.backends.checkpoints.latest(job)
    return latest.step if latest else None


def _readmit(rt: Runtime, job: str, back: list[str]) -> str:
    """The node the job was let back on: one of `back` (barred by this incident, since returned to
    service), while the job finds no other node free (no spare, no idle node); "" for none yet."""
    return next((node for node in back if rt.backends.scheduler.readmit(job, node)), "")


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


def _job(rt: Runtime, job: str) -> JobInfo:
    info = rt.backends.scheduler.job(job)
    if info is None:
        raise LookupError(f"job {job} vanished after requeue")
    return info


@task(
    name="resume job",
    task_run_name="resume job {job}",
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=transient_only,
    timeout_seconds=1800,
)
def resume_job(incident_id: str, job: str, exclude: list[str], wait_s: float = 900) -> ResumeOutcome:
    rt = current()
    with stage(rt.store, incident_id, "resume job", why=f"moved off {', '.join(exclude)}") as log:
        started = time.monotonic()
        restart = _moved_before(rt, incident_id, job, exclude)
        if restart is None:
            restart, info = _requeue(rt, incident_id, job, exclude)
        else:
            info = _job(rt, job)  # moved off before the act: one requeue per incident, never two
        outcome = _await_progress(rt, incident_id, job, restart, info, exclude, started, wait_s)
        log.done(f"{outcome.describe()} on {', '.join(outcome.nodes)}", **outcome.model_dump())
        return outcome


def restart_key(job: str, hung_at: datetime) -> str:
    """One restart per hang: its events (one per node) share the job and the time it was named."""
    return f"hang:{job}:{hung_at.isoformat()}:{RESTART}"


@task(
    name="restart hung job",
    task_run_name="restart hung job {job}",
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=transient_only,
    timeout_seconds=1800,
)
def restart_hung_job(
    incident_id: str, node: str, job: str, hung_at: datetime, wait_s: float = 900
) -> ResumeOutcome | None:
    """Requeue a job named hung (at `hung_at`) onto the nodes it has, and wait until it trains past its
    checkpoint; None when there was nothing to restart or another incident of the hang restarts it."""
    rt = current()
    with stage(
        rt.store, incident_id, "restart hung job", node=node, why="hung, named before its watchdog"
    ) as log:
        started = time.monotonic()
        key = restart_key(job, hung_at)
        info = rt.backends.scheduler.job(job)
        if info is None or info.state is not JobState.RUNNING:
            # Ended, or requeued by someone else meanwhile: the hang is over either way.
            state = "gone" if info is None else info.state.value
            log.done(f"job {job} no longer runs ({state}): nothing to restart", status=StepStatus.SKIPPED)
            return None
        row, claimed = rt.store.claim_action(key, incident_id, node, RESTART)
        if not claimed:
            owner = f"incident {row.incident_id}"
            log.done(
                f"job {job} restarted for this hang by {owner} ({row.status})", status=StepStatus.SKIPPED
            )
            return None
        try:
            restart, info = _requeue(rt, incident_id, job, [])
        except Exception as error:
            rt.store.finish_action(key, ActionStatus.FAILED, f"{type(error).__name__}: {error}")
            raise
        rt.store.finish_action(
            key, ActionStatus.SUCCEEDED, f"job {job} requeued in place{restart.describe()}"
        )
        outcome = _await_progress(rt, incident_id, job, restart, info, [], started, wait_s)
        log.done(f"{outcome.describe()} on {', '.join(outcome.nodes)}", **outcome.model_dump())
        return outcome


def _await_progress(
    rt: Runtime,
    incident_id: str,
    job: str,
    restart: Restart,
    info: JobInfo,
    exclude: list[str],
    started: float,
    wait_s: float,
) -> ResumeOutcome:
    """Wait until the requeued job trains past its checkpoint, letting it back onto one of `exclude`
    once that node is back and the job has nowhere else to go."""
    floor = restart.checkpoint_step or 0
    # Done when the job trains past its checkpoint, not when the scheduler says "running".
    # A scheduler that knows no training steps (Slurm) can only tell that the requeued job
    # runs again; then a newer checkpoint is the proof of progress we wait for, if any.
    delay = 0.05
    readmitted = ""
    while not _progressed(rt, job, info, floor):
        if time.monotonic() - started > wait_s:
            raise TimeoutError(f"job {job} did not pass step {floor} within {wait_s:.0f} s")
        back = [] if readmitted else [n for n in exclude if returned(rt, incident_id, n)]
        readmitted = readmitted or _readmit(rt, job, back)
        time.sleep(delay)
        # Once its node is back, a job that may be waiting for it is looked at every second: the
        # sooner it is let back on, the sooner it trains.
        delay = min(delay * 2, READMIT_POLL_S if back and not readmitted else RESUME_POLL_S)
        info = _job(rt, job)
    return ResumeOutcome(
        job=job,
        checkpoint_step=restart.checkpoint_step,
        resumed_step=info.step if info.step is not None else _checkpoint_step(rt, job),
        lost_seconds=restart.lost_seconds,
        seconds_to_resume=(utcnow() - restart.requeued_at).total_seconds(),
        nodes=list(info.nodes),
        spare=restart.spare,
        readmitted=readmitted,
    )
