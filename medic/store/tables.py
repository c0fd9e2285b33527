"""The audit and incident tables. Our store, not Prefect's history, is the system of record."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Index, Text, UniqueConstraint, text
from sqlmodel import Field, SQLModel

from medic.statuses import IncidentStatus
from medic.store.types import UTCDateTime


def _time(*, index: bool = False, nullable: bool = False) -> Any:
    return Field(sa_column=Column(UTCDateTime(), index=index, nullable=nullable))


def _json() -> Any:
    return Field(default=None, sa_column=Column(JSON, nullable=True))


class EventRecord(SQLModel, table=True):
    __tablename__ = "events"

    id: str = Field(primary_key=True, max_length=200)
    time: datetime = _time(index=True)
    received_at: datetime = _time()
    source: str
    kind: str = Field(index=True)
    node: str = Field(index=True)
    # BIGINT: the schema bounds none of these, and PostgreSQL's INTEGER stops at 2**31 - 1.
    gpu: int | None = Field(default=None, sa_type=BigInteger)
    job: str | None = Field(default=None, index=True)
    rank: int | None = Field(default=None, sa_type=BigInteger)
    iteration: int | None = Field(default=None, sa_type=BigInteger)
    switch: str | None = None
    attributes: dict[str, Any] | None = _json()
    incident_id: str | None = Field(default=None, index=True)
    # The event this one is evidence of, where the differential absorbed it (a victim's crash, a
    # hang's timeouts: medic/culprit.py): in no incident, and handed on no more (revision 0005).
    explained_by: str | None = None


class RejectedRecord(SQLModel, table=True):
    """The dead letter: input that was not an event, kept verbatim with the reason."""

    __tablename__ = "rejected_events"

    id: int | None = Field(default=None, primary_key=True)
    received_at: datetime = _time(index=True)
    origin: str
    raw: str = Field(sa_column=Column(Text, nullable=False))
    reason: str = Field(sa_column=Column(Text, nullable=False))


class RejectionCountRecord(SQLModel, table=True):
    """Every rejection, counted by where it came from and why: the dead letter keeps only a
    sample of a flood (medic/store/rejections.py), so this is what says how big the flood was."""

    __tablename__ = "rejection_counts"
    __table_args__ = (UniqueConstraint("source", "reason_class"),)

    id: int | None = Field(default=None, primary_key=True)
    source: str  # the origin without its line or index: `http:10.0.0.7`, `events.jsonl`
    reason_class: str  # medic.intake.reason_class: a few words, so that the rows stay few
    rejected: int = Field(default=0, sa_type=BigInteger)
    kept: int = Field(default=0, sa_type=BigInteger)  # of them, rows in rejected_events
    first_seen: datetime = _time()
    last_seen: datetime = _time(index=True)


# The statuses of an incident still being handled (medic.statuses.ACTIVE_INCIDENT_STATUSES), spelled
# out for the partial index: an index's WHERE clause is SQL, fixed when the index is created.
ACTIVE_SQL = "status IN ('open', 'remediating', 'waiting for approval')"


class IncidentRecord(SQLModel, table=True):
    __tablename__ = "incidents"
    # One incident at a time is handled per node (per switch for a storm), whatever the number of
    # replicas and ingests opening one at once: the loser's events join the winner's incident.
    __table_args__ = (
        Index(
            "uq_incidents_one_active",
            "node",
            "scope",
            unique=True,
            sqlite_where=text(ACTIVE_SQL),
            postgresql_where=text(ACTIVE_SQL),
        ),
    )

    id: str = Field(primary_key=True)
    node: str = Field(index=True)  # the switch's name when scope is "switch"
    scope: str = Field(default="node")  # node | switch
    switch: str | None = None
    opened_at: datetime = _time(index=True)
    last_event_at: datetime = _time()
    closed_at: datetime | None = _time(nullable=True)
    # The statuses are StrEnums (medic/statuses.py) over a plain string column: rows read back hold str.
    status: str = Field(default=IncidentStatus.OPEN, index=True)  # an IncidentStatus
    jobs: list[str] | None = _json()
    owner: str | None = Field(default=None, index=True)
    classification: str | None = None
    action: str | None = None
    rule: str | None = None
    outcome: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    flow_run_id: str | None = None
    flow_run_name: str | None = None
    # The process whose run handles the incident, until when (renewed while it runs): a run that
    # died lets its lease lapse, and another process picks the incident up (medic/flows/leases.py).
    runner: str | None = None
    lease_until: datetime | None = _time(nullable=True)


class StepRecord(SQLModel, table=True):
    """One stage of one flow run: what it did, how long it took, how it ended."""

    __tablename__ = "steps"

    id: int | None = Field(default=None, primary_key=True)
    incident_id: str = Field(index=True)
    stage: str
    started_at: datetime = _time()
    finished_at: datetime = _time()
    status: str  # a StepStatus
    summary: str = Field(default="", sa_column=Column(Text, nullable=False))
    detail: dict[str, Any] | None = _json()


class DiagnosticRecord(SQLModel, table=True):
    __tablename__ = "diagnostics"

    id: int | None = Field(default=None, primary_key=True)
    incident_id: str = Field(index=True)
    node: str = Field(index=True)
    level: int
    result: str  # pass | fail | error
    error_ids: list[str] | None = _json()
    started_at: datetime = _time()
    finished_at: datetime = _time()
    detail: str = Field(default="", sa_column=Column(Text, nullable=False))


class DecisionRecord(SQLModel, table=True):
    __tablename__ = "decisions"

    id: int | None = Field(default=None, primary_key=True)
    incident_id: str = Field(index=True)
    decided_at: datetime = _time()
    policy_path: str
    policy_sha256: str
    rule: str
    classification: str
    action: str
    diagnose_level: int | None = None
    reason: str = Field(sa_column=Column(Text, nullable=False))
    matched: list[str] | None = _json()
    recommend: list[str] | None = _json()
    guardrail: str | None = None
    blocked_action: str | None = None
    # What the engine saw (medic.whatif.replay.FactsRecord), so that `medic policy replay` decides
    # again on the same facts; None for decisions recorded before it was kept.
    facts: dict[str, Any] | None = _json()
    # The node's mode and group when it was decided (decision 0017); NULL before revision 0004, when
    # every decision was acted on as `remediate` says.
    mode: str | None = None
    node_group: str | None = None

    def mode_said(self) -> str:
        """The mode and group in words where groups change anything ("observe mode, group canary");
        "" for a node remediated as before groups existed."""
        if not self.node_group and self.mode in (None, "remediate"):
            return ""
        return f"{self.mode} mode" + (f", group {self.node_group}" if self.node_group else "")


class ActionRecord(SQLModel, table=True):
    """A node action: its intent is written before the call, its outcome after.

    `key` (incident, node, action) is unique: the same fault can never act twice.
    """

    __tablename__ = "actions"
    __table_args__ = (UniqueConstraint("key"),)

    id: int | None = Field(default=None, primary_key=True)
    key: str
    incident_id: str = Field(index=True)
    node: str = Field(index=True)
    action: str
    status: str  # an ActionStatus
    attempts: int = 0
    intent_at: datetime = _time()
    finished_at: datetime | None = _time(nullable=True)
    detail: str = Field(default="", sa_column=Column(Text, nullable=False))


class GoodputRecord(SQLModel, table=True):
    """What one incident cost one job (medic/goodput.py), written when the incident closes."""

    __tablename__ = "goodput"
    __table_args__ = (UniqueConstraint("incident_id", "job"),)

    id: int | None = Field(default=None, primary_key=True)
    incident_id: str = Field(index=True)
    job: str = Field(index=True)
    fault_at: datetime = _time(index=True)
    detection_s: float
    diagnosis_s: float
    action_s: float
    recovery_s: float | None = None
    lost_work_s: float | None = None


class ApprovalRecord(SQLModel, table=True):
    """A request for a human's approval and its answer: who, when, through what."""

    __tablename__ = "approvals"

    id: int | None = Field(default=None, primary_key=True)
    incident_id: str = Field(index=True)
    action: str
    requested_at: datetime = _time()
    answered_at: datetime | None = _time(nullable=True)
    approved: bool | None = None
    by: str | None = None
    via: str | None = None  # slack | prefect | timeout
    comment: str = Field(default="", sa_column=Column(Text, nullable=False))


class BreakerRecord(SQLModel, table=True):
    """The circuit breaker's history: a row per opening, closed by a named human."""

    __tablename__ = "breaker"
    # At most one opening is current, whatever the number of replicas opening it at once.
    __table_args__ = (
        Index(
            "uq_breaker_one_open",
            text("(closed_at IS NULL)"),
            unique=True,
            sqlite_where=text("closed_at IS NULL"),
            postgresql_where=text("closed_at IS NULL"),
        ),
    )

    id: int | None = Field(default=None, primary_key=True)
    opened_at: datetime = _time()
    reason: str = Field(sa_column=Column(Text, nullable=False))
    incident_id: str | None = None
    closed_at: datetime | None = _time(nullable=True)
    closed_by: str | None = None


class ModeChangeRecord(SQLModel, table=True):
    """A change of the mode a node group (or the policy's other nodes, `*`) runs in, as a newly read
    policy file made it: who owned the file, when it took effect, which file (decision 0017).
    One row per group and policy version, however many replicas read the file."""

    __tablename__ = "mode_changes"
    __table_args__ = (UniqueConstraint("node_group", "policy_sha256"),)

    id: int | None = Field(default=None, primary_key=True)
    changed_at: datetime = _time()
    node_group: str  # a group's name, or "*" for the nodes no group takes
    mode: str | None  # None: the group was removed, its nodes take the policy's mode
    previous: str | None  # None: the group is new
    by: str
    policy_path: str
    policy_sha256: str


class OutboxRecord(SQLModel, table=True):
    """A chat message on its way (medic/tasks/notify.py): written when the flow says it, settled once it is
    delivered or given up. Not audited: a delivery queue, whose outcomes are the `notify` and `update`
    steps. The process sending a message holds it (`owner`, renewed while it tries); a message whose
    holder is gone is claimed and sent again by another process (docs/slack.md)."""

    __tablename__ = "outbox"

    id: int | None = Field(default=None, primary_key=True)  # the order the messages were said in
    incident_id: str = Field(index=True)
    stage: str  # notify: a message of its own; update: a reply in its parent's thread
    message: dict[str, Any] | None = _json()  # a message of its own: medic.protocols.Message
    text: str = Field(default="", sa_column=Column(Text, nullable=False))  # a reply's text
    parent_id: int | None = None  # a reply's message: the row whose thread it goes in
    status: str = Field(index=True)  # a MessageStatus
    tries: int = 0
    error: str = Field(default="", sa_column=Column(Text, nullable=False))  # the last try's
    ref: str | None = None  # the thread, once a message of its own is posted
    owner: str | None = None  # the process sending it: "host:notify:pid" (medic/tasks/runners.py)
    lease_until: datetime | None = _time(nullable=True)
    created_at: datetime = _time()
    settled_at: datetime | None = _time(nullable=True)


class AuditChainRecord(SQLModel, table=True):
    """The ledger: one entry per write of an audited row, appended in the write's own transaction
    (medic/store/ledger.py). Entries are never updated; a prune removes whole runs of them and
    records where (`audit_prunes`)."""

    __tablename__ = "audit_chain"
    __table_args__ = (
        Index("ix_audit_chain_incident", "incident_id", "seq"),
        Index("ix_audit_chain_row", "table_name", "row_key", "seq"),
    )

    seq: int = Field(sa_column=Column(BigInteger, primary_key=True, autoincrement=False))
    at: datetime = _time()
    table_name: str
    row_key: str
    incident_id: str | None = None
    digest: str | None = None  # the row's content (medic.store.chain.row_digest); None: deleted
    prev_hash: str
    incident_prev_hash: str | None = None
    key_id: str | None = None  # which MEDIC_AUDIT_KEY keyed `hash`; None: unkeyed
    hash: str


class AuditPruneRecord(SQLModel, table=True):
    """A prune: what left the store, for which archive, and the runs of ledger entries it removed,
    so that the chain still links across them."""

    __tablename__ = "audit_prunes"

    id: int | None = Field(default=None, primary_key=True)
    pruned_at: datetime = _time()
    before: datetime = _time()
    archive: str  # the file's name as given
    archive_sha256: str  # of the archive's content (medic/store/archive.py)
    incidents: int
    rows: int
    entries: int
    head_seq: int = Field(sa_type=BigInteger)  # the chain's head when the archive was written
    head_hash: str
    runs: list[list[Any]] = Field(sa_column=Column(JSON, nullable=False))  # medic.store.chain.Run
