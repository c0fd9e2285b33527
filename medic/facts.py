"""What the policy engine sees of an incident: facts distilled once from its events.

Rules are evaluated against these plain values, never against raw events, so the engine
stays pure and fast and `medic policy explain` can print exactly what a rule saw.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from medic import dcgm_errors, xid
from medic.ageing import PastIncident
from medic.context import EMPTY, Window
from medic.dcgm_errors import Severity
from medic.events import EventKind, FaultEvent
from medic.incidents import Incident
from medic.profile_diff import Cause

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


class CauseEvidence(BaseModel):
    """One entry that grew on the slow rank against its healthy peer (medic/profile_diff.py's evidence)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str  # the operator, the collective, the copy, the data loader or the Python function
    category: str
    grew_s: float = Field(allow_inf_nan=False)  # seconds a step more than the peer's
    ratio: float | None = Field(None, allow_inf_nan=False)  # the suspect's time in it over the peer's

    def describe(self) -> str:
        """`aten::addmm [64x32] +4.1 ms/step (x1.9)`."""
        ratio = f" (x{self.ratio:.1f})" if self.ratio is not None else ""
        return f"{self.name} +{self.grew_s * 1000:.1f} ms/step{ratio}"


class _Said(BaseModel):
    """The verdict's attributes on a straggler event, as `medic serve` attaches them (docs/culprit.md)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    straggler_cause: str
    straggler_cause_confidence: float = Field(0.0, ge=0, le=1)
    straggler_cause_where: str | None = None
    straggler_cause_evidence: list[Any] = Field(default_factory=list)
    straggler_cause_peer_artifact: str | None = None
    artifact: str | None = None  # the straggler's own trace, which the verdict was read from


@dataclass(frozen=True, slots=True)
class StragglerVerdict:
    """Why the straggler is slow: its profile against a healthy peer's, over the same steps."""

    cause: Cause
    confidence: float
    where: str | None  # the operator or function that grew most
    evidence: tuple[CauseEvidence, ...] = ()
    artifact: str | None = None  # the straggler's trace
    peer_artifact: str | None = None  # the healthy peer's, over the same steps

    @property
    def hardware(self) -> bool:
        return self.cause.hardware

    def describe(self) -> str:
        """`software-python (confidence 0.97) in train.py(42): hot_spot`."""
        where = f" in {self.where}" if self.where else ""
        return f"{self.cause.value} (confidence {self.confidence:.2f}){where}"

    def text(self) -> str:
        """For a chat message: the verdict, and what grew most as a small monospaced table."""
        lines = [f"Why it is slow: {self.describe()}"]
        if self.evidence:
            lines += ["```", *(row.describe() for row in self.evidence[:TOP_EVIDENCE]), "```"]
        return "\n".join(lines)


UNREADABLE = StragglerVerdict(Cause.UNKNOWN, 0.0, None)
TOP_EVIDENCE = 3  # rows people are shown: the diff names the largest growths first


def verdict_of(attributes: Mapping[str, Any]) -> StragglerVerdict | None:
    """The verdict a straggler event's attributes carry; None when they carry none. A verdict that
    cannot be read, or a cause this version does not know, is `unknown`: never hardware, never
    software, so a policy that names causes fails closed to its other rules."""
    if "straggler_cause" not in attributes:
        return None
    try:
        said = _Said.model_validate(attributes)
    except ValidationError:
        return UNREADABLE
    known = {c.value for c in Cause}
    cause = Cause(said.straggler_cause) if said.straggler_cause in known else Cause.UNKNOWN
    return StragglerVerdict(
        cause=cause,
        confidence=said.straggler_cause_confidence if cause is not Cause.UNKNOWN else 0.0,
        where=said.straggler_cause_where,
        evidence=tuple(_rows(said.straggler_cause_evidence)),
        artifact=said.artifact or None,
        peer_artifact=said.straggler_cause_peer_artifact or None,
    )


def _rows(raw: list[Any]) -> Iterable[CauseEvidence]:
    # The rows only show people what grew; one malformed row is left out rather than the verdict lost.
    for row in raw:
        try:
            yield CauseEvidence.model_validate(row)
        except ValidationError:
            continue


class Reported(Protocol):
    """An event as the policy reads it (FaultEvent) or as the store keeps it (EventRecord)."""

    @property
    def kind(self) -> str: ...
    @property
    def time(self) -> datetime: ...
    @property
    def attributes(self) -> Mapping[str, Any] | None: ...


def straggler_verdict(events: Iterable[Reported]) -> StragglerVerdict | None:
    """The verdict of the latest straggler event that carries one (the last of those at one time)."""
    latest: Reported | None = None
    for event in events:
        says = event.kind == EventKind.STRAGGLER and "straggler_cause" in (event.attributes or {})
        if says and (latest is None or event.time >= latest.time):
            latest = event
    return verdict_of(latest.attributes or {}) if latest is not None else None


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
    context: Window
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
    def straggler_verdict(self) -> StragglerVerdict | None:
        """Why the straggler is slow, from the latest straggler event that says (None: none says).
        Read from the events, not kept: a replay rebuilds it from the stored events, so decisions
        recorded before verdicts existed replay unchanged."""
        return straggler_verdict(self.events)

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
    context: Window = EMPTY,
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
