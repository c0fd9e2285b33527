"""What the policy engine sees of an incident: facts distilled once from its events.

Rules are evaluated against these plain values, never against raw events, so the engine
stays pure and fast and `medic policy explain` can print exactly what a rule saw.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from medic import dcgm_errors, xid
from medic.ageing import PastIncident
from medic.context import EMPTY, Context
from medic.dcgm_errors import Severity
from medic.events import EventKind, FaultEvent
from medic.incidents import Incident

HISTORY_WINDOW = timedelta(days=7)
# Recorded `remediation` actions that leave a node out of service, and those that return it.
TAKES_OUT = frozenset({"drain", "reset_gpu", "reboot", "replace"})
RETURNS = frozenset({"resume", "reintegrate"})
OUR_SOURCE = "medic"  # the source of the events GPU Medic writes about its own actions
# health_check `check` names the agent gives NVSwitch SXids and NVLink error counters (docs/xid.md).
SXID_CHECK = "nvswitch_sxid"
NVLINK_ERRORS_CHECK = "nvlink_errors"


@dataclass(frozen=True, slots=True)
class DiagnosticFact:
    level: int
    result: str  # "pass" | "fail"
    error_names: tuple[str, ...]
    worst_severity: Severity | None


@dataclass(frozen=True, slots=True)
class Facts:
    incident: str
    node: str
    nodes: tuple[str, ...]
    jobs: tuple[str, ...]
    gpus: tuple[int, ...]
    event_count: int
    kinds: frozenset[EventKind]
    xid_codes: frozenset[int]
    dcgm_errors: frozenset[str]
    dcgm_severities: frozenset[Severity]
    ecc_dbe: int
    ecc_sbe: int
    straggler_reports: int
    straggler_max_ratio: float
    diagnostics: tuple[DiagnosticFact, ...]  # in the order they ran
    out_of_service: bool
    recent_remediations: int  # our actions on this node in the last 7 days
    events: tuple[FaultEvent, ...]
    switch: str | None
    dcgm_categories: frozenset[str]
    now: datetime
    context: Context
    # NVIDIA's catalog bucket of each XID code (medic/xid.py), and what XID 154 asked for.
    xid_resolutions: frozenset[str] = frozenset()
    recovery_actions: frozenset[str] = frozenset()
    row_remap: frozenset[str] = frozenset()  # "pending" and/or "failure", as NVML reported them
    nvlink_errors: int = 0  # NVLink error counter rises the incident's events reported
    sxids: frozenset[int] = frozenset()  # NVSwitch SXid codes
    sxid_severities: frozenset[str] = frozenset()  # "fatal" and/or "non_fatal"
    # The node's earlier incidents as far back as `gpu_incidents` conditions look (oldest first).
    gpu_history: tuple[PastIncident, ...] = ()

    @property
    def latest_diagnostic(self) -> DiagnosticFact | None:
        return self.diagnostics[-1] if self.diagnostics else None

    @property
    def highest_level_run(self) -> int:
        return max((d.level for d in self.diagnostics), default=0)


def _dcgm_names(errors: Iterable[int | str]) -> tuple[tuple[str, ...], list[Severity], list[str]]:
    names: list[str] = []
    severities: list[Severity] = []
    categories: list[str] = []
    for raw in errors:
        known = dcgm_errors.lookup(raw)
        names.append(known.name if known else str(raw))
        severities.append(known.severity if known else Severity.UNKNOWN)
        categories.append(known.category if known else "UNKNOWN")
    return tuple(names), severities, categories


def facts_of(
    incident: Incident,
    *,
    out_of_service: bool = False,
    now: datetime | None = None,
    context: Context = EMPTY,
    gpu_history: tuple[PastIncident, ...] = (),
) -> Facts:
    """Distil an incident. `now` ends every time window (defaults to the incident's last event);
    `context` holds recent events from the rest of the cluster for cross-node conditions;
    `gpu_history` the node's earlier incidents, for `gpu_incidents`."""
    now = now or incident.last_at
    xids: set[int] = set()
    dcgm_names: set[str] = set()
    dcgm_severities: set[Severity] = set()
    dcgm_categories: set[str] = set()
    dbe = sbe = stragglers = 0
    straggler_max = 0.0
    diagnostics: list[DiagnosticFact] = []
    recovery: set[str] = set()
    row_remap: set[str] = set()
    nvlink_errors = 0
    sxids: set[int] = set()
    sxid_severities: set[str] = set()
    for event in incident.events:
        attrs = event.attributes
        if attrs.get("row_remap_pending") is True:
            row_remap.add("pending")
        if attrs.get("row_remap_failure") is True:
            row_remap.add("failure")
        match event.kind:
            case EventKind.XID:
                xids.add(int(attrs["code"]))
                if int(attrs["code"]) == xid.RECOVERY_ACTION_CODE:
                    recovery.add(_recovery_action(attrs))
            case EventKind.HEALTH_CHECK if attrs.get("check") == SXID_CHECK and isinstance(
                attrs.get("sxid"), int
            ):
                sxids.add(attrs["sxid"])
                sxid_severities.add("fatal" if attrs.get("fatal") is True else "non_fatal")
            case EventKind.HEALTH_CHECK if attrs.get("check") == NVLINK_ERRORS_CHECK:
                rise = attrs.get("nvlink_errors")
                nvlink_errors += rise if isinstance(rise, int) and rise > 0 else 0
            case EventKind.DCGM_HEALTH:
                names, severities, categories = _dcgm_names([attrs["error_id"]])
                dcgm_names.update(names)
                dcgm_severities.update(severities)
                dcgm_categories.update(categories)
            case EventKind.ECC:
                dbe += int(attrs.get("dbe", 0))
                sbe += int(attrs.get("sbe", 0))
            case EventKind.STRAGGLER:
                stragglers += 1
                straggler_max = max(straggler_max, float(attrs["step_time_ratio"]))
            case EventKind.DIAGNOSTIC:
                names, severities, _ = _dcgm_names(attrs.get("error_ids", []))
                if attrs.get("worst_severity") in Severity.__members__.values():
                    severities.append(Severity(attrs["worst_severity"]))  # stated for ids newer than ours
                diagnostics.append(
                    DiagnosticFact(int(attrs["level"]), attrs["result"], names, dcgm_errors.worst(severities))
                )
    recent = [h for h in incident.history if now - h.time <= HISTORY_WINDOW]
    return Facts(
        incident=incident.id,
        node=incident.node,
        nodes=tuple(incident.nodes),
        jobs=tuple(incident.jobs),
        gpus=tuple(sorted({e.gpu for e in incident.events if e.gpu is not None})),
        event_count=len(incident.events),
        kinds=frozenset(e.kind for e in incident.events),
        xid_codes=frozenset(xids),
        dcgm_errors=frozenset(dcgm_names),
        dcgm_severities=frozenset(dcgm_severities),
        ecc_dbe=dbe,
        ecc_sbe=sbe,
        straggler_reports=stragglers,
        straggler_max_ratio=straggler_max,
        diagnostics=tuple(diagnostics),
        out_of_service=out_of_service,
        recent_remediations=len(recent),
        events=tuple(incident.events),
        switch=incident.switch,
        dcgm_categories=frozenset(dcgm_categories),
        now=now,
        context=context,
        xid_resolutions=frozenset(xid.resolution(code).value for code in xids),
        recovery_actions=frozenset(recovery),
        row_remap=frozenset(row_remap),
        nvlink_errors=nvlink_errors,
        sxids=frozenset(sxids),
        sxid_severities=frozenset(sxid_severities),
        gpu_history=gpu_history,
    )


def taken_out_by_us(history: Iterable[FaultEvent]) -> bool:
    """Whether a node's recorded remediations (oldest first) leave it out of service by us: its last
    one that takes it out or returns it is a drain, reset, reboot or replacement of ours (source
    `medic`), however long ago. The replayed counterpart of a node the scheduler shows drained by us:
    a passing diagnostic then reintegrates it. Anyone's resume returns it; someone else's drain
    after ours makes it theirs."""
    out = False
    for event in history:
        action = event.attributes.get("action")
        if action in RETURNS:
            out = False
        elif action in TAKES_OUT:
            out = event.source == OUR_SOURCE
    return out


def _recovery_action(attrs: dict[str, object]) -> str:
    """XID 154's action: an explicit `recovery_action` attribute, else the one its message states."""
    given = attrs.get("recovery_action")
    if isinstance(given, str) and given in {a.value for a in xid.RecoveryAction}:
        return given
    message = attrs.get("message")
    return xid.recovery_action(message if isinstance(message, str) else None).value
