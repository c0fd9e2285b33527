"""Keeping what a reboot or replacement destroys: the node's kernel log, `nvidia-smi -q` and bug
report (`HostEvidence`), and its recent events from the store, as files under the artifact root,
read after the node is drained and its jobs are off, just before the provider is called
(docs/host-evidence.md).

Best effort: the evidence is worth a bounded wait, never the fix. Nothing here raises into the
action; a capture that fails or runs out of time is a failed `host evidence` step and a warning in
the run's log, and the action goes ahead. Kept once per action: an `act` retried after the
provider's error finds its evidence recorded and does not read the node again.
"""

from __future__ import annotations

import logging
import re
from datetime import timedelta
from pathlib import Path

from medic.artifacts import Artifact
from medic.events import FaultEvent
from medic.policy import Action
from medic.statuses import StepStatus
from medic.store import utcnow
from medic.tasks.runtime.process import Runtime
from medic.tasks.runtime.stage import run_logger, stage

log = logging.getLogger("medic.host_evidence")

STAGE = "host evidence"
KEPT_BEFORE = frozenset({Action.REBOOT, Action.REPLACE})
# Held under the node-actions slot (medic/tasks/nodes/guard.py): every other node's transition waits this long
# at most for it.
CAPTURE_TIMEOUT_S = 120.0
EVENTS_WINDOW = timedelta(hours=1)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def _safe(part: str) -> str:
    """One path component: a name from outside cannot climb out of the root or hide as a dot file."""
    return _UNSAFE.sub("_", part).lstrip(".") or "_"


def evidence_dir(root: Path, incident_id: str, node: str, action: Action) -> Path:
    return root / "host-evidence" / _safe(incident_id) / f"{_safe(node)}-{action.value}"


def keep_host_evidence(rt: Runtime, incident_id: str, node: str, action: Action, key: str) -> str | None:
    """Capture and keep the node's evidence before `action` (claimed as `key`). Returns a few words
    for the action's outcome; None when nothing is kept for this action or no root is configured."""
    root = rt.artifact_root
    if root is None or action not in KEPT_BEFORE:
        return None
    try:
        if _kept_already(rt, incident_id, key):
            return "host evidence kept already"
        with stage(rt.store, incident_id, STAGE, node=node, why=f"before {action.value}") as step:
            try:
                said, status, kept = _keep(rt, incident_id, node, action, root)
            except Exception as error:  # best effort: the action goes ahead whatever failed here
                said, status, kept = f"none kept ({type(error).__name__}: {error})", StepStatus.FAILED, []
            step.done(
                f"{said}; {action.value} goes ahead" if status == StepStatus.FAILED else said,
                status=status,
                action=key,
                artifacts=[{"what": a.what, "path": a.path} for a in kept],
            )
    except Exception as error:  # the store is down too: the log line is what is left
        run_logger(log).warning("%s: host evidence of %s not recorded: %s", incident_id, node, error)
        return f"host evidence not recorded ({type(error).__name__})"
    if status == StepStatus.FAILED:
        return f"no host evidence read off {node} (step {STAGE!r} says why)"
    return f"host evidence kept ({len(kept)} files)"


def _kept_already(rt: Runtime, incident_id: str, key: str) -> bool:
    detail = rt.store.incident_detail(incident_id)
    return detail is not None and any(
        s.stage == STAGE and s.status == StepStatus.OK and (s.detail or {}).get("action") == key
        for s in detail.steps
    )


def _keep(
    rt: Runtime, incident_id: str, node: str, action: Action, root: Path
) -> tuple[str, StepStatus, list[Artifact]]:
    capture = rt.backends.host_evidence.capture(node, CAPTURE_TIMEOUT_S)
    folder = evidence_dir(root, incident_id, node, action)
    folder.mkdir(parents=True, exist_ok=True)
    kept: list[Artifact] = []
    for part in capture.files:
        path = folder / _safe(part.name)
        path.write_bytes(part.content)
        kept.append(Artifact(f"{part.what} of {node} before {action.value}", str(path)))
    events = _recent_events(rt, incident_id, node)
    path = folder / "events.jsonl"
    path.write_text("".join(f"{e.model_dump_json()}\n" for e in events), encoding="utf-8")
    kept.append(Artifact(f"recent events of {node} before {action.value} ({len(events)})", str(path)))
    missing = f"; not kept: {'; '.join(capture.missing)}" if capture.missing else ""
    if not capture.files:
        return (
            f"nothing read off {node}{missing}; its recent events kept in {folder}",
            StepStatus.FAILED,
            kept,
        )
    return f"kept {len(kept)} files in {folder}{missing}", StepStatus.OK, kept


def _recent_events(rt: Runtime, incident_id: str, node: str) -> list[FaultEvent]:
    """The incident's events and the node's others of the last EVENTS_WINDOW, by time."""
    now = utcnow()
    nearby = [e for e in rt.store.events_between(now - EVENTS_WINDOW, now) if e.node == node]
    events = {e.id: e for e in [*rt.store.incident_events(incident_id), *nearby]}
    return sorted(events.values(), key=lambda e: (e.time, e.id))
