"""Slurm hooks: a DCGM diagnostic on this node, reported to GPU Medic (docs/agent.md).

    python -m apps.hooks prolog        # Prolog: DCGM level 1 before each job
    python -m apps.hooks epilog        # Epilog: DCGM level 2, only after a job that failed
    python -m apps.hooks healthcheck   # HealthCheckProgram: DCGM level 1

deployments/slurm/medic-*.sh call this with PATH and Python set (Slurm gives hooks no PATH).
Events go where the agent's do: $MEDIC_EVENTS_FILE, else $MEDIC_URL (+ $MEDIC_TOKEN), else stdout.

Exit status: 0, except a prolog whose diagnostic failed while MEDIC_PROLOG_FAIL_CLOSED=1: 10, which
the script turns into 1 (Slurm then drains the node and requeues the job). An epilog never fails:
a non-zero Epilog makes Slurm drain the node by itself, and what to do about a failed diagnostic
is GPU Medic's policy's decision.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from integrations.dcgm.diagnostics import DcgmDiagnostics
from integrations.dcgm.runner import LocalRunner
from integrations.sinks import sink_from
from medic.events import EventKind, FaultEvent
from medic.protocols import DiagnosticResult

log = logging.getLogger("apps.hooks")

SOURCE = "slurm"
LEVELS = {"prolog": 1, "epilog": 2, "healthcheck": 1}
# dcgmi's own run times are ~10 s (level 1) and ~2 min (level 2); past these something hangs.
DEFAULT_TIMEOUT_S = {1: 120.0, 2: 600.0}
USAGE = "usage: python -m apps.hooks prolog|epilog|healthcheck"
# A failed diagnostic in a fail-closed prolog; deployments/slurm/medic-hook.sh turns it into 1 and
# every other non-zero status (a crash, a Python without GPU Medic) into 0.
FAIL_CLOSED = 10


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


def _event(kind: EventKind, node: str, job: str | None, **attributes: Any) -> FaultEvent:
    return FaultEvent(
        id=f"slurm-{uuid.uuid4().hex}",
        time=datetime.now(UTC),
        source=SOURCE,
        kind=kind,
        node=node,
        job=job,
        attributes=attributes,
    )


def run_hook(phase: str, env: Mapping[str, str]) -> int:
    level = LEVELS[phase]
    if phase == "epilog":
        failed = job_failed(env)
        if not failed:
            ended = "succeeded" if failed is False else "ended with no exit code in the environment"
            log.info("job %s %s: no diagnostic", env.get("SLURM_JOB_ID", "?"), ended)
            return 0
    node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    timeout_s = float(env.get("MEDIC_HOOK_TIMEOUT_S") or DEFAULT_TIMEOUT_S[level])
    # The hook runs on the node it checks, whatever name Slurm knows the node by.
    diagnostics = DcgmDiagnostics(LocalRunner(aliases=[node]), dcgmi=env.get("MEDIC_DCGMI") or "dcgmi")
    result = diagnostics.run(node, level, timeout_s)
    log.info("%s: %s", phase, result.detail)
    sink_from(env.get("MEDIC_EVENTS_FILE") or None, env).emit(events_for(result, phase, env))
    if phase == "prolog" and result.result == "fail" and env.get("MEDIC_PROLOG_FAIL_CLOSED") == "1":
        print(f"GPU Medic: DCGM level {level} failed on {node}: {result.detail}", file=sys.stderr)
        return FAIL_CLOSED
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] not in LEVELS:
        print(USAGE, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        return run_hook(args[0], os.environ)
    except Exception:
        # Only a failed diagnostic may fail a hook: a non-zero Prolog or Epilog drains the node,
        # and a bug or a misconfiguration here is no reason to take GPUs out of service.
        log.exception("%s hook could not run; exiting 0", args[0])
        return 0


if __name__ == "__main__":
    sys.exit(main())
