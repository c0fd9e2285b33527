"""The policy schema: what SREs write in policies/*.yaml (documented in docs/policy.md).

Unknown keys are errors everywhere, so a misspelt condition can never silently match all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from medic.context import Around
from medic.dcgm_errors import Severity
from medic.errors import PermanentError
from medic.events import EventKind, FaultEvent
from medic.incidents import StormRule, Storms
from medic.policy.approvers import APPROVER_PATTERN, check_entry
from medic.policy.deep_checks import DeepChecks
from medic.policy.selectors import Mode, Selector, overlap
from medic.profile_diff import Cause
from medic.xid import RecoveryAction, Resolution

# Windows, gaps and cooldowns are bounded: a duration of a year is already beyond any rule's
# meaning, and a larger one would overflow the datetime arithmetic when the rule is evaluated.
MAX_MINUTES = 525_600
Minutes = Annotated[int, Field(gt=0, le=MAX_MINUTES)]


class Action(StrEnum):
    NONE = "none"
    DIAGNOSE = "diagnose"
    RESET_GPU = "reset_gpu"
    REBOOT = "reboot"
    REPLACE = "replace"
    DRAIN = "drain"
    REINTEGRATE = "reintegrate"
    ESCALATE = "escalate"


class Classification(StrEnum):
    HARDWARE = "hardware"
    SOFTWARE = "software"
    INFRASTRUCTURE = "infrastructure"
    UNKNOWN = "unknown"


# Precedence among matching rules: the most far-reaching node action wins (docs/policy.md).
ACTION_RANK: dict[Action, int] = {
    Action.REPLACE: 7,
    Action.REBOOT: 6,
    Action.RESET_GPU: 5,
    Action.DIAGNOSE: 4,
    Action.DRAIN: 3,
    Action.ESCALATE: 2,
    Action.REINTEGRATE: 1,
    Action.NONE: 0,
}

# Actions that take a node (or a GPU) away from its jobs.
DESTRUCTIVE = frozenset({Action.RESET_GPU, Action.REBOOT, Action.REPLACE})
OUT_OF_SERVICE = DESTRUCTIVE | {Action.DRAIN}


class DuplicateRuleId(PermanentError, ValueError):
    """Raised when two rules share an id; carries the second one's index, so the loader can point at it."""

    def __init__(self, rule_id: str, index: int) -> None:
        super().__init__(f"rule id {rule_id!r} is used twice")
        self.index = index


class Located(ValueError):
    """A model's own check that knows where its problem is: the loader reports it at `loc`'s line."""

    def __init__(self, loc: tuple[int | str, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StragglerCondition(_Strict):
    ratio_at_least: float = Field(1.2, gt=0)
    reports_at_least: PositiveInt = 3


class DiagnosticCondition(_Strict):
    """About the latest diagnostic run for the incident."""

    result: Literal["pass", "fail"] | None = None
    level_at_least: int | None = Field(None, ge=1, le=4)
    worst_severity: list[Severity] | None = Field(
        None, description="The failed run's most drastic DCGM severity is one of these."
    )


class Signature(_Strict):
    """Which events count: any of `kinds`, and for XIDs optionally only these codes."""

    kinds: list[EventKind] | None = None
    xid: list[int] | None = Field(None, description="Only XID events with these codes (implies kind xid).")

    @model_validator(mode="after")
    def _something(self) -> Signature:
        if not self.kinds and not self.xid:
            raise ValueError("give `kinds`, `xid` or both")
        return self

    def event_kinds(self) -> tuple[EventKind, ...]:
        kinds = set(self.kinds or ())
        if self.xid:
            kinds.add(EventKind.XID)
        return tuple(sorted(kinds))

    def describe(self) -> str:
        parts = [k.value for k in self.kinds or () if not (self.xid and k is EventKind.XID)]
        if self.xid:
            parts.append("XID " + "/".join(map(str, self.xid)))
        return " or ".join(parts)


class CountCondition(Signature):
    """Events with the signature in the last `within_minutes`, across the cluster, counted per scope.

    The incident must itself show the signature; `scope` then says which other events count:
    the same GPU, the same node, the same job(s), or the whole cluster. `distinct` counts events,
    or the different nodes / jobs / GPUs among them. `same_iteration_rank` keeps only events at
    an (iteration, rank) the incident also reported: the mark of a deterministic software bug.
    """

    scope: Literal["gpu", "node", "job", "cluster"] = "node"
    distinct: Literal["events", "episodes", "nodes", "jobs", "gpus"] = Field(
        "events",
        description="What to count; `episodes` are bursts separated by more than episode_gap_minutes "
        "(a storm of one failure is one episode).",
    )
    episode_gap_minutes: Minutes = 10
    same_iteration_rank: bool = False
    at_least: PositiveInt
    within_minutes: Minutes = 60


class SwitchCondition(_Strict):
    """Trouble on many nodes under the incident's leaf switch (or rack) at once: the network."""

    kinds: list[EventKind]
    nodes_at_least: PositiveInt | None = None
    fraction_at_least: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Of the nodes under the switch; needs the switch's size (the scheduler's).",
    )
    within_minutes: Minutes = 5

    @model_validator(mode="after")
    def _threshold(self) -> SwitchCondition:
        if self.nodes_at_least is None and self.fraction_at_least is None:
            raise ValueError("give nodes_at_least, fraction_at_least or both")
        return self


class GpuIncidentsCondition(_Strict):
    """The same GPU in incident after incident, across jobs: the hardware ageing, not the code.

    Counts the incidents that named one of the incident's GPUs (node and index) in the last
    `within_days`, this one included; those the policy called `software` do not count."""

    at_least: PositiveInt
    within_days: int = Field(14, gt=0, le=MAX_MINUTES // 1440)
    distinct_jobs_at_least: PositiveInt = Field(1, description="Different jobs among those incidents.")


class When(_Strict):
    """All conditions given must hold; a rule with an empty `when` never matches."""

    kinds: list[EventKind] | None = Field(None, description="Any event of one of these kinds.")
    not_kinds: list[EventKind] | None = Field(None, description="No event of any of these kinds.")
    xid: list[int] | None = Field(None, description="Any XID event with one of these codes.")
    xid_resolution: list[Resolution] | None = Field(
        None,
        description="Any XID event whose code's resolution bucket in NVIDIA's XID catalog "
        "(medic/data/xid_catalog.csv, docs/xid.md) is one of these.",
    )
    xid_recovery_action: list[RecoveryAction] | None = Field(
        None, description="Any XID 154 whose message states one of these GPU recovery actions."
    )
    row_remap: list[Literal["pending", "failure"]] | None = Field(
        None, description="An event reports a row remap of one of these states (NVML)."
    )
    nvlink_errors_at_least: PositiveInt | None = Field(
        None,
        description="The NVLink error counter rises the incident's events report add up to at least this.",
    )
    sxid: list[Literal["fatal", "non_fatal"]] | None = Field(
        None, description="An NVSwitch SXid of one of these severities (health_check `nvswitch_sxid`)."
    )
    dcgm_errors: list[str] | None = Field(None, description="Any dcgm_health event with these DCGM_FR_* ids.")
    dcgm_severity: list[Severity] | None = Field(
        None, description="Any dcgm_health event whose DCGM severity is one of these."
    )
    dcgm_category: list[str] | None = Field(
        None, description="Any dcgm_health event whose DCGM category is one of these (e.g. HARDWARE_MEMORY)."
    )
    ecc_dbe_at_least: PositiveInt | None = None
    straggler: StragglerCondition | None = None
    straggler_cause: list[Cause] | None = Field(
        None,
        min_length=1,
        description="The incident's straggler verdict (the latest straggler event's `straggler_cause`: the "
        "slow rank's profile against a healthy peer's, docs/culprit.md) is one of these. An incident "
        "without a verdict never matches.",
    )
    diagnostic: DiagnosticCondition | None = None
    out_of_service: bool | None = Field(None, description="The node is drained or down by us.")
    recent_remediations_at_least: PositiveInt | None = Field(
        None, description="Our node actions on this node in the last 7 days."
    )
    recent_remediations_at_most: NonNegativeInt | None = Field(
        None, description="At most this many of our node actions on this node in the last 7 days."
    )
    min_events: PositiveInt | None = None
    count: list[CountCondition] | None = Field(None, description="Windowed counts; all must hold.")
    switch: SwitchCondition | None = None
    gpu_incidents: GpuIncidentsCondition | None = Field(
        None, description="Incidents on the same GPU within days, across jobs (docs/fleet-health.md)."
    )

    def is_empty(self) -> bool:
        return all(value is None for value in self.model_dump().values())


class Then(_Strict):
    classification: Classification
    action: Action
    diagnose_level: int | Literal["next"] | None = Field(
        None, description="For action diagnose: the DCGM level (1-4) or `next` after the latest run."
    )
    diagnose_up_to: int | None = Field(
        None,
        ge=1,
        le=4,
        description="Climb on from diagnose_level while the rule still holds (e.g. a pass), up to this level.",
    )
    recommend: list[str] = Field(default_factory=list, description="What the owner should do.")
    owner: str | None = Field(
        None, description="Tell this owner (a key of `owners`, e.g. network) instead of the job's owner."
    )
    approve: bool = Field(False, description="A human must approve the action first (see `approvals`).")

    @model_validator(mode="after")
    def _level_for_diagnose(self) -> Then:
        if self.action is Action.DIAGNOSE and self.diagnose_level is None:
            raise ValueError("action diagnose needs diagnose_level (1-4 or next)")
        if isinstance(self.diagnose_level, int) and not 1 <= self.diagnose_level <= 4:
            raise ValueError("diagnose_level must be between 1 and 4")
        if self.diagnose_up_to is not None and (
            not isinstance(self.diagnose_level, int) or self.diagnose_up_to < self.diagnose_level
        ):
            raise ValueError("diagnose_up_to needs a numeric diagnose_level no higher than it")
        return self


class Rule(_Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    description: str
    priority: int = 0
    override: bool = Field(
        False, description="Wins over every rule without override (repeat offenders, escalations)."
    )
    when: When
    then: Then

    @field_validator("when")
    @classmethod
    def _has_conditions(cls, when: When, info: ValidationInfo) -> When:
        # A field validator, so the error points at the `when:` line rather than the rule's first.
        if when.is_empty():
            raise ValueError(f"rule {info.data.get('id', '?')}: `when` needs at least one condition")
        return when


class CircuitBreaker(_Strict):
    """Opens when too many nodes are taken out of service within the window; a human closes it.

    While open, no node is taken out of service (the decision escalates instead); returning
    healthy nodes to service (reintegrate) still goes on.
    """

    nodes_percent: float | None = Field(None, gt=0, le=100)
    nodes_at_least: PositiveInt | None = None
    window_minutes: Minutes = 5


class Guardrails(_Strict):
    max_out_of_service: PositiveInt | None = Field(
        None, description="Nodes out of service at once (see count_out_of_service_by_others)."
    )
    max_out_of_service_percent: float | None = Field(
        None, gt=0, le=100, description="Of the fleet (rounded up, so a small fleet can still fix one node)."
    )
    max_destructive_per_hour: PositiveInt | None = Field(None, description="reset_gpu, reboot and replace.")
    node_cooldown_minutes: NonNegativeInt | None = Field(
        None, le=MAX_MINUTES, description="Minimum time between two destructive actions on one node."
    )
    count_out_of_service_by_others: bool = Field(
        True,
        description="max_out_of_service* counts every node the scheduler shows drained, down or rebooting, "
        "for any reason (an admin, a health check, a crash); false: only the nodes GPU Medic took out.",
    )
    circuit_breaker: CircuitBreaker | None = None
    never_touch: list[str] = Field(
        default_factory=list, description="Node names or shell patterns (gpu-node-1*) never acted on."
    )


Approver = Annotated[
    str,
    AfterValidator(check_entry),
    # Editors flag a display name as it is typed; the loader's own message says why.
    WithJsonSchema({"type": "string", "pattern": APPROVER_PATTERN}),
]


class Approvals(_Strict):
    """Who may approve actions the policy reserves for humans, and what happens without an answer."""

    approvers: list[Approver] = Field(
        default_factory=list,
        description="Slack user ids (U... or W...) or emails allowed to approve or reject; never display "
        "names, which anyone can take. An email is resolved to its user's id through Slack.",
    )
    required_for: list[Action] = Field(
        default_factory=list,
        description="Actions that always need a human's approval, whatever rule asks for them "
        "(the default policy: [replace], which wipes the node).",
    )
    timeout_minutes: float = Field(60, gt=0, le=MAX_MINUTES)
    on_timeout: Literal["escalate", "proceed"] = Field(
        "escalate", description="escalate: keep the node drained and hand it to humans."
    )


class Defaults(_Strict):
    incident_window_minutes: Minutes = 10
    classification: Classification = Classification.UNKNOWN
    action: Action = Action.NONE
    max_diagnose_level: int = Field(4, ge=1, le=4)
    verify_level: int = Field(1, ge=1, le=4, description="DCGM level run before a node returns.")
    storm_hold_seconds: float = Field(
        5,
        ge=0,
        le=300,
        description="How long `medic serve` holds an event a `switch` condition counts before treating it "
        "as one node's trouble: long enough for the neighbours under its switch to report.",
    )
    stall_settle_seconds: float = Field(
        15,
        ge=1,
        le=600,
        description="How long `medic serve` gathers a job's stall reports after the first before naming "
        "the rank stalled behind its peers as a hang (docs/culprit.md): at least a quarter of the jobs' "
        "stall-watch period, which is how far apart the ranks' reports come.",
    )


class Spares(_Strict):
    nodes: NonNegativeInt = Field(
        0,
        le=10_000,
        description="Idle nodes held back as spares (docs/spares.md): a job requeued off a node that "
        "must go lands on one at once; a repaired node refills the pool after its verification. 0: none.",
    )


class GroupGuardrails(_Strict):
    """Limits over a group's own nodes, held besides the policy's (which still count the whole fleet):
    an NVL72 rack that may lose one tray at a time, say. The circuit breaker stays the fleet's."""

    max_out_of_service: PositiveInt | None = Field(
        None, description="The group's nodes out of service at once."
    )
    max_out_of_service_percent: float | None = Field(
        None,
        gt=0,
        le=100,
        description="Of the group's nodes (rounded up, so a small group can still fix one).",
    )
    max_destructive_per_hour: PositiveInt | None = Field(
        None, description="reset_gpu, reboot and replace on the group's nodes."
    )
    node_cooldown_minutes: NonNegativeInt | None = Field(
        None, le=MAX_MINUTES, description="Minimum time between two destructive actions on one of its nodes."
    )
    never_touch: list[str] = Field(
        default_factory=list, description="More node names or shell patterns never acted on."
    )


class GroupApprovals(_Strict):
    """What a group changes of `approvals` for its nodes; the approvers stay the policy's, whom the Slack
    buttons check. A key left out keeps the policy's value."""

    required_for: list[Action] | None = Field(None, description="Instead of the policy's list.")
    timeout_minutes: float | None = Field(None, gt=0, le=MAX_MINUTES)
    on_timeout: Literal["escalate", "proceed"] | None = None


class ReadinessThresholds(_Strict):
    """When the rollout report calls a group ready for more automatic mode (docs/rollout.md#readiness):
    all three must hold."""

    min_decisions: int = Field(
        50, ge=0, le=1_000_000, description="Would-have decisions (observe mode, a node action) at least."
    )
    min_agreement: float = Field(
        0.95,
        ge=0,
        le=1,
        description="Share of the judged would-have decisions people or the node bore out, at least (0 to 1).",
    )
    max_destructive_disagreements: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Would-have reset_gpu, reboot or replace decisions that were disagreed or a false alarm, "
        "at most.",
    )


class GroupReadinessThresholds(_Strict):
    """What a group changes of `readiness` for its own report; a key left out keeps the policy's value."""

    min_decisions: int | None = Field(None, ge=0, le=1_000_000)
    min_agreement: float | None = Field(None, ge=0, le=1)
    max_destructive_disagreements: int | None = Field(None, ge=0, le=1_000_000)


GROUP_NAME = r"^[a-z0-9][a-z0-9_.-]*$"


class Group(_Strict):
    """Nodes picked by what the scheduler says of them, with their own mode and, optionally, their own
    limits, approvals and rules (docs/policy.md#groups)."""

    name: str = Field(pattern=GROUP_NAME)
    description: str = ""
    select: Selector
    mode: Mode = Field(
        description="observe: tell what would be done; contain: drain and move jobs off, "
        "repairs need approval; remediate: act."
    )
    guardrails: GroupGuardrails | None = Field(
        None, description="Limits over the group's own nodes, besides the policy's over the fleet."
    )
    approvals: GroupApprovals | None = Field(
        None,
        description="What changes of `approvals` for the group's nodes (the approvers stay the policy's).",
    )
    rules: list[Rule] = Field(
        default_factory=list,
        description="More rules for the group's nodes, decided with the policy's (ids unique across the policy).",
    )
    readiness: GroupReadinessThresholds | None = Field(
        None, description="What changes of `readiness` for the group's rollout report."
    )


class Policy(_Strict):
    version: Literal[1] = 1
    description: str = ""
    mode: Mode = Field(
        Mode.REMEDIATE, description="For every node no group takes: observe, contain or remediate."
    )
    groups: list[Group] = Field(
        default_factory=list,
        description="Node groups, each with its mode; a node in none takes `mode`, a node in two has none "
        "(its incidents escalate).",
    )
    defaults: Defaults = Field(default_factory=Defaults)
    owners: dict[str, str] = Field(
        default_factory=dict, description="Owner or team name -> Slack channel or user."
    )
    guardrails: Guardrails = Field(default_factory=Guardrails)
    approvals: Approvals = Field(default_factory=Approvals)
    deep_checks: DeepChecks = Field(
        default_factory=DeepChecks,
        description="Node shapes and the checks a node passes before it returns to service (docs/deep-checks.md).",
    )
    spares: Spares = Field(default_factory=Spares)
    readiness: ReadinessThresholds = Field(
        default_factory=ReadinessThresholds,
        description="When `medic rollout report` calls a group ready (docs/rollout.md#readiness).",
    )
    rules: list[Rule]

    def every_rule(self) -> list[Rule]:
        """The policy's rules and its groups': what any decision may read of the context."""
        return [*self.rules, *(r for g in self.groups for r in g.rules)]

    def lookback(self) -> timedelta:
        """How far back cross-node conditions look: the context a decision needs."""
        rules = self.every_rule()
        minutes = [c.within_minutes for r in rules for c in r.when.count or ()]
        minutes += [r.when.switch.within_minutes for r in rules if r.when.switch]
        return timedelta(minutes=max(minutes, default=60))

    def gpu_history_lookback(self) -> timedelta:
        """How far back `gpu_incidents` conditions look at the node's earlier incidents (0: none)."""
        days = [r.when.gpu_incidents.within_days for r in self.every_rule() if r.when.gpu_incidents]
        return timedelta(days=max(days, default=0))

    def context_kinds(self) -> frozenset[EventKind]:
        """The kinds of events cross-node conditions look at: all a decision reads of the context."""
        rules = self.every_rule()
        kinds = {k for r in rules for c in r.when.count or () for k in c.event_kinds()}
        kinds.update(k for r in rules if r.when.switch for k in r.when.switch.kinds)
        return frozenset(kinds)

    def around(self, events: Iterable[FaultEvent], node: str, switch: str | None) -> Around:
        """What of the cluster's recent events a decision on these incident events can read: the
        slices its rules' counts and switch conditions look in (medic/policy/engine.py), all of
        them where a count looks across the cluster without a step mark."""
        events = list(events)
        rules = self.every_rule()
        everywhere = any(
            c.scope == "cluster" and not c.same_iteration_rank for r in rules for c in r.when.count or ()
        )
        return Around(
            kinds=self.context_kinds(),
            nodes=frozenset({node, *(e.node for e in events)}),
            jobs=frozenset(e.job for e in events if e.job is not None),
            switches=frozenset(
                {*(e.switch for e in events if e.switch is not None), *filter(None, [switch])}
            ),
            iterations=frozenset(e.iteration for e in events if e.iteration is not None),
            everywhere=everywhere,
        )

    def storms(self, switch_sizes: Mapping[str, int] | None = None) -> Storms:
        """What correlation makes one switch-wide incident: the events the rules' `switch` conditions count."""
        rules = tuple(
            StormRule(
                frozenset(c.kinds), timedelta(minutes=c.within_minutes), c.nodes_at_least, c.fraction_at_least
            )
            for r in self.every_rule()
            if (c := r.when.switch) is not None
        )
        return Storms(rules, switch_sizes or {})

    @model_validator(mode="after")
    def _unique_ids(self) -> Policy:
        seen: set[str] = set()
        for index, rule in enumerate(self.rules):
            if rule.id in seen:
                raise DuplicateRuleId(rule.id, index)
            seen.add(rule.id)
        for g, group in enumerate(self.groups):
            for index, rule in enumerate(group.rules):
                if rule.id in seen:
                    raise Located(("groups", g, "rules", index, "id"), f"rule id {rule.id!r} is used twice")
                seen.add(rule.id)
        return self

    @model_validator(mode="after")
    def _groups_apart(self) -> Policy:
        """Every node in one group at most, as far as the file shows: a node two groups take has no mode."""
        for b, later in enumerate(self.groups):
            for earlier in self.groups[:b]:
                if later.name == earlier.name:
                    raise Located(("groups", b, "name"), f"group name {later.name!r} is used twice")
                why = overlap(earlier.select, later.select)
                if why is not None:
                    raise Located(
                        ("groups", b, "select"),
                        f"group {later.name!r} overlaps group {earlier.name!r} ({why}): "
                        "a node in both would have no mode; make the selectors exclusive",
                    )
        return self


class Decision(_Strict):
    """The engine's answer for one incident; recorded verbatim in the store."""

    incident: str
    classification: Classification
    action: Action
    diagnose_level: int | None = None
    rule: str
    reason: str
    recommend: list[str] = Field(default_factory=list)
    matched: list[str] = Field(default_factory=list, description="Every rule that matched, winner first.")
    policy_sha256: str = ""
    owner: str | None = Field(None, description="Who to tell, when the rule names one.")
    approve: bool = Field(False, description="A human must approve before the action is taken.")
    guardrail: str | None = Field(None, description="The guardrail that stopped the rule's action.")
    blocked_action: Action | None = Field(
        None, description="What the rule asked for, when a guardrail said no."
    )
    mode: Mode = Field(Mode.REMEDIATE, description="The mode of the node's group when it was decided.")
    group: str | None = Field(None, description="The node's group; None: no group took it.")
