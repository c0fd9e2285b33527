"""Slurm hooks: checks of this node's GPUs, reported to GPU Medic (docs/agent.md).

    python -m medic.apps.hooks prolog        # Prolog: the preflight (NVML quick checks, then DCGM level 1)
    python -m medic.apps.hooks epilog        # Epilog: DCGM level 2, only after a job that failed
    python -m medic.apps.hooks healthcheck   # HealthCheckProgram: DCGM level 1

medic/slurm_hooks/medic-*.sh call this with PATH and Python set (Slurm gives hooks no PATH).
Events go where the agent's do: $MEDIC_EVENTS_FILE, else $MEDIC_URL (+ $MEDIC_TOKEN), else stdout.

The prolog's preflight runs within MEDIC_PROLOG_BUDGET_S: the quick checks first (milliseconds),
then DCGM level 1 in what is left. medic/preflight.py judges; this module reads, runs and reports.

Exit status: 0, except a prolog whose preflight failed while MEDIC_PROLOG_FAIL_CLOSED=1: it drains
the node with our reason (`medic: preflight <check>: <detail>`) and exits 10, which the script turns
into 1 (Slurm then requeues the job). An epilog never fails: a non-zero Epilog makes Slurm drain the
node by itself, and what to do about a failed diagnostic is GPU Medic's policy's decision.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from medic import preflight
from medic.events import EventKind, FaultEvent
from medic.gpu_state import Unavailable
from medic.integrations import nvml_preflight
from medic.integrations.dcgm.diagnostics import DcgmDiagnostics
from medic.integrations.dcgm.runner import DEFAULT_TERM_GRACE_S, LocalRunner
from medic.integrations.nvml import snapshot
from medic.integrations.sinks import sink_from
from medic.integrations.slurm import SlurmCli, SlurmError, SlurmScheduler
from medic.preflight import Failure, Verdict
from medic.protocols import DiagnosticResult

log = logging.getLogger("medic.apps.hooks")

SOURCE = "slurm"
LEVELS = {"prolog": 1, "epilog": 2, "healthcheck": 1}
# dcgmi's own run times are ~10 s (level 1) and ~2 min (level 2); past these something hangs.
DEFAULT_TIMEOUT_S = {1: 120.0, 2: 600.0}
USAGE = "usage: python -m medic.apps.hooks prolog|epilog|healthcheck"
# A failed preflight in a fail-closed prolog; medic/slurm_hooks/medic-hook.sh turns it into 1 and
# every other non-zero status (a crash, a Python without GPU Medic) into 0.
FAIL_CLOSED = 10
# Per command of the drain (one `sinfo --json`, one `scontrol update`); slurmctld answers in
# milliseconds, and one that does not must not hold the prolog for SlurmCli's usual 30 s each.
DRAIN_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class PrologSettings:
    budget_s: float = preflight.DEFAULT_BUDGET_S
    expected_gpus: int | None = None  # None: the GPU count is not checked
    fail_closed: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PrologSettings:
        """MEDIC_PROLOG_BUDGET_S, MEDIC_EXPECTED_GPUS, MEDIC_PROLOG_FAIL_CLOSED; ValueError names a bad one."""
        given = env.get("MEDIC_PROLOG_BUDGET_S") or str(preflight.DEFAULT_BUDGET_S)
        try:
            budget = float(given)
        except ValueError:
            budget = float("nan")
        if not 0 < budget < float("inf"):
            raise ValueError(f"MEDIC_PROLOG_BUDGET_S={given!r}: must be a number of seconds above 0")
        expected = env.get("MEDIC_EXPECTED_GPUS", "").strip()
        if expected and not expected.isdigit():
            raise ValueError(f"MEDIC_EXPECTED_GPUS={expected!r}: must be a whole number, 0 or more")
        return cls(budget, int(expected) if expected else None, env.get("MEDIC_PROLOG_FAIL_CLOSED") == "1")


def job_failed(env: Mapping[str, str]) -> bool | None:
    """Whether the job that just ended failed: a non-zero exit code or signal. None: unknown.

    SLURM_JOB_EXIT_CODE2 is `exit:signal`; SLURM_JOB_EXIT_CODE is the raw wait(2) status."""
    pair = env.get("SLURM_JOB_EXIT_CODE2", "")
    if pair:
        code, _, signal = pair.partition(":")
        try:
            return int(code) != 0 or int(signal or 0) != 0
        except ValueError:
            log.warning("SLURM_JOB_EXIT_CODE2=%r is not exit:signal", pair)
    status = env.get("SLURM_JOB_EXIT_CODE", "")
    return int(status) != 0 if status.strip().isdigit() else None


def events_for(result: DiagnosticResult, phase: str, env: Mapping[str, str]) -> list[FaultEvent]:
    """A `diagnostic` event for a verdict about the GPUs, plus a `health_check` unless it passed."""
    job = env.get("SLURM_JOB_ID") or None
    events = []
    if result.result in ("pass", "fail"):
        events.append(
            _event(
                EventKind.DIAGNOSTIC,
                result.node,
                job,
                level=result.level,
                result=result.result,
                error_ids=list(result.error_ids),
                phase=phase,
                detail=result.detail,
            )
        )
    if result.result != "pass":
        # "error": dcgmi could not say (missing, hung, hostengine down) - no verdict, but a fault to look at.
        events.append(
            _event(
                EventKind.HEALTH_CHECK,
                result.node,
                job,
                phase=phase,
                check="dcgm_diag",
                message=result.detail,
                level=result.level,
                result=result.result,
            )
        )
    return events


def _event(
    kind: EventKind, node: str, job: str | None, gpu: int | None = None, **attributes: Any
) -> FaultEvent:
    return FaultEvent(
        id=f"slurm-{uuid.uuid4().hex}",
        time=datetime.now(UTC),
        source=SOURCE,
        kind=kind,
        node=node,
        gpu=gpu,
        job=job,
        attributes=attributes,
    )


def preflight_events(
    failures: Sequence[Failure], node: str, env: Mapping[str, str], **outcome: Any
) -> list[FaultEvent]:
    """A failed preflight: one `health_check` (`check: preflight`) with every failed check and
    `outcome` (drained, budget, elapsed...), and the events the agent sends for the same findings."""
    job = env.get("SLURM_JOB_ID") or None
    gpus = {f.gpu for f in failures if f.gpu is not None}
    summary = _event(
        EventKind.HEALTH_CHECK,
        node,
        job,
        gpus.pop() if len(gpus) == 1 else None,
        phase="prolog",
        **preflight.summary(failures),
        **outcome,
    )
    found = [
        _event(kind, node, job, gpu, phase="prolog", check="preflight", **facts)
        for kind, gpu, facts in preflight.agent_events(failures)
    ]
    return [summary, *found]


def slurm_drain(node: str, reason: str, env: Mapping[str, str]) -> None:
    """Drain through the Slurm scheduler, which leaves a node held for someone else's reason as it
    is (NodeHeldByOthersError). Raises SlurmError."""
    SlurmScheduler(SlurmCli(env.get("SLURM_CONF"), timeout_s=DRAIN_TIMEOUT_S)).drain(node, reason)


Drain = Callable[[str, str, Mapping[str, str]], None]


def run_hook(
    phase: str,
    env: Mapping[str, str],
    read_nvml: nvml_preflight.Reader = snapshot,
    drain: Drain = slurm_drain,
) -> int:
    # The hook runs on the node it checks, whatever name Slurm knows the node by.
    node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    if phase == "prolog":
        return run_prolog(node, env, PrologSettings.from_env(env), read_nvml, drain)
    if phase == "epilog":
        failed = job_failed(env)
        if not failed:
            ended = "succeeded" if failed is False else "ended with no exit code in the environment"
            log.info("job %s %s: no diagnostic", env.get("SLURM_JOB_ID", "?"), ended)
            return 0
    level = LEVELS[phase]
    result = _diagnostics(node, env).run(
        node, level, float(env.get("MEDIC_HOOK_TIMEOUT_S") or DEFAULT_TIMEOUT_S[level])
    )
    log.info("%s: %s", phase, result.detail)
    sink_from(env.get("MEDIC_EVENTS_FILE") or None, env).emit(events_for(result, phase, env))
    return 0


def _diagnostics(node: str, env: Mapping[str, str]) -> DcgmDiagnostics:
    return DcgmDiagnostics(LocalRunner(aliases=[node]), dcgmi=env.get("MEDIC_DCGMI") or "dcgmi")


def run_prolog(
    node: str,
    env: Mapping[str, str],
    settings: PrologSettings,
    read_nvml: nvml_preflight.Reader = snapshot,
    drain: Drain = slurm_drain,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """The preflight within the budget: NVML's quick checks, then (only if they pass: the verdict
    is in otherwise) DCGM level 1 in what is left. Failing closed, a failure drains the node."""
    started = clock()
    verdict = quick_checks(settings, read_nvml)
    if verdict.unsupported:
        log.info("prolog: not supported here, so not checked: %s", "; ".join(verdict.unsupported))
    failures = list(verdict.failures)
    result = None
    if not failures:
        timeout_s = preflight.dcgm_timeout(settings.budget_s, clock() - started, DEFAULT_TERM_GRACE_S)
        if timeout_s <= 0:
            failures.append(preflight.no_time_for("DCGM level 1", clock() - started, settings.budget_s))
        else:
            began = clock()
            result = _diagnostics(node, env).run(node, 1, timeout_s)
            log.info("prolog: %s", result.detail)
            failures += _dcgm_failures(result, clock() - began, timeout_s, settings.budget_s)
    elapsed_s = round(clock() - started, 3)
    events = events_for(result, "prolog", env) if result else []
    if not failures:
        log.info("prolog: preflight passed on %s in %.3f s", node, elapsed_s)
        sink_from(env.get("MEDIC_EVENTS_FILE") or None, env).emit(events)
        return 0
    reason = preflight.drain_reason(failures)
    outcome: dict[str, Any] = {
        "not_supported": list(verdict.unsupported),
        "fail_closed": settings.fail_closed,
        "budget_s": settings.budget_s,
        "elapsed_s": elapsed_s,
    }
    if settings.fail_closed:
        drain_error = _drain(drain, node, reason, env)
        outcome |= {"drain_error": drain_error} if drain_error else {"drained": reason}
    events += preflight_events(failures, node, env, **outcome)
    sink_from(env.get("MEDIC_EVENTS_FILE") or None, env).emit(events)
    log.warning("prolog: preflight failed on %s in %.3f s: %s", node, elapsed_s, reason)
    if not settings.fail_closed:
        return 0
    print(f"GPU Medic: {reason}", file=sys.stderr)
    return FAIL_CLOSED


def quick_checks(settings: PrologSettings, read_nvml: nvml_preflight.Reader = snapshot) -> Verdict:
    """NVML's quick checks, judged; an NVML that does not answer within the budget is an overrun."""
    found = nvml_preflight.read(settings.budget_s, read_nvml)
    if found is None:
        return Verdict((preflight.overrun("the NVML read", settings.budget_s, settings.budget_s),))
    if isinstance(found, Unavailable):
        return preflight.judge_unavailable(found.reason, settings.expected_gpus)
    return preflight.judge(found, settings.expected_gpus)


def _dcgm_failures(
    result: DiagnosticResult, ran_s: float, timeout_s: float, budget_s: float
) -> list[Failure]:
    """A failed level 1, or one stopped at its share of the budget. Any other `error` (dcgmi
    missing, nv-hostengine down) is no verdict about the GPUs and fails nothing."""
    if result.result == "fail":
        return [Failure("dcgm_l1", result.detail)]
    if result.result == "error" and ran_s >= timeout_s:
        return [preflight.overrun("DCGM level 1", timeout_s, budget_s)]
    return []


def _drain(drain: Drain, node: str, reason: str, env: Mapping[str, str]) -> str | None:
    """Why the node could not be drained with our reason, or None when it was."""
    try:
        drain(node, reason, env)
    except SlurmError as error:
        log.error(
            "prolog: could not drain %s (%s); Slurm drains it itself for the failed prolog", node, error
        )
        return str(error)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] not in LEVELS:
        print(USAGE, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        return run_hook(args[0], os.environ)
    except Exception:
        # Only a failed preflight may fail a hook: a non-zero Prolog or Epilog drains the node,
        # and a bug or a misconfiguration here is no reason to take GPUs out of service.
        log.exception("%s hook could not run; exiting 0", args[0])
        return 0


if __name__ == "__main__":
    sys.exit(main())
