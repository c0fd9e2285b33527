"""The post-mortem report over a window of incidents (`medic report`, docs/report.md).

Pure: built from the rows the store returns (medic/store/report.py). Its JSON is a public
contract for the SREs' own tools: `schema_version` changes when a key is renamed or removed.
Durations are seconds; a percentile is the nearest rank, a value that occurred.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

from medic.goodput import IncidentCost, job_goodput
from medic.holds import Hold
from medic.statuses import IncidentStatus
from medic.store.report import ReportRows
from medic.store.tables import ApprovalRecord, IncidentRecord

SCHEMA_VERSION = 1
# Fixed bins, so that two reports' histograms compare: a person's units from seconds to a day.
HISTOGRAM_EDGES_S = (0, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21_600, 43_200, 86_400)
PERCENTILES = (0.5, 0.9, 0.99)

Answer = Literal["approved", "denied", "timed out", "pending"]


class IncidentRow(BaseModel):
    id: str
    node: str  # the switch's name when scope is "switch"
    scope: str
    opened_at: datetime
    closed_at: datetime | None
    status: str
    classification: str | None
    action: str | None
    rule: str | None
    jobs: list[str]
    repair_s: float | None  # opened → closed, for a closed incident
    first_action_s: float | None  # first event → first node action done (or claimed)


class Count(BaseModel):
    value: str | None  # None: not decided yet
    incidents: int


class Bin(BaseModel):
    from_s: float
    to_s: float | None  # None: no upper bound
    incidents: int


class Distribution(BaseModel):
    incidents: int
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    max_s: float | None
    histogram: list[Bin]


class NodeCount(BaseModel):
    node: str
    incidents: int


class GpuCount(BaseModel):
    node: str
    gpu: int
    incidents: int


class JobLoss(BaseModel):
    """medic goodput's per-job figures, without checkpoint overhead."""

    job: str
    failures: int
    detection_s: float
    recovery_s: float
    lost_work_s: float
    downtime_s: float  # detection + recovery


class Approval(BaseModel):
    incident: str
    node: str | None
    action: str
    requested_at: datetime
    answered_at: datetime | None
    answer: Answer
    by: str | None
    via: str | None
    wait_s: float | None  # requested → answered


class Approver(BaseModel):
    by: str
    approved: int
    denied: int


class Report(BaseModel):
    schema_version: int = SCHEMA_VERSION
    generated_at: datetime
    since: datetime | None
    incidents: list[IncidentRow]
    by_status: list[Count]
    by_classification: list[Count]
    by_action: list[Count]
    by_rule: list[Count]
    mttr: Distribution
    time_to_first_action: Distribution
    nodes: list[NodeCount]  # most incidents first
    gpus: list[GpuCount]
    goodput_lost: list[JobLoss]  # most downtime first
    approvals: list[Approval]
    approvers: list[Approver]
    # The nodes GPU Medic holds out of service when the report is made, whatever the window: the store's
    # record (`medic node held` adds the scheduler's view).
    held: list[Hold] = []


def build_report(rows: ReportRows, *, since: datetime | None, now: datetime) -> Report:
    first_event: dict[str, datetime] = {}
    by_node: defaultdict[str, set[str]] = defaultdict(set)
    by_gpu: defaultdict[tuple[str, int], set[str]] = defaultdict(set)
    for t in rows.touches:
        first_event[t.incident_id] = min(t.first_at, first_event.get(t.incident_id, t.first_at))
        by_node[t.node].add(t.incident_id)
        if t.gpu is not None:
            by_gpu[(t.node, t.gpu)].add(t.incident_id)
    incidents = [_row(i, first_event.get(i.id), rows.first_actions.get(i.id)) for i in rows.incidents]
    nodes_of = {i.id: i.node for i in rows.incidents}
    return Report(
        generated_at=now,
        since=since,
        incidents=incidents,
        by_status=_counts(i.status for i in incidents),
        by_classification=_counts(i.classification for i in incidents),
        by_action=_counts(i.action for i in incidents),
        by_rule=_counts(i.rule for i in incidents),
        mttr=distribution(i.repair_s for i in incidents),
        time_to_first_action=distribution(i.first_action_s for i in incidents),
        nodes=sorted(
            (NodeCount(node=n, incidents=len(ids)) for n, ids in by_node.items()),
            key=lambda c: (-c.incidents, c.node),
        ),
        gpus=sorted(
            (GpuCount(node=n, gpu=g, incidents=len(ids)) for (n, g), ids in by_gpu.items()),
            key=lambda c: (-c.incidents, c.node, c.gpu),
        ),
        goodput_lost=_goodput_lost([IncidentCost.of(r) for r in rows.goodput]),
        approvals=[_approval(a, nodes_of.get(a.incident_id)) for a in rows.approvals],
        approvers=_approvers(rows.approvals),
        held=rows.held,
    )


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    # The first event's time is the source's clock: a skew must not make a negative duration.
    return max(0.0, (end - start).total_seconds())


def _row(
    incident: IncidentRecord, first_event: datetime | None, first_action: datetime | None
) -> IncidentRow:
    # Escalated incidents were handed to people: when they were repaired is not ours to know.
    closed = incident.status == IncidentStatus.CLOSED
    return IncidentRow(
        id=incident.id,
        node=incident.node,
        scope=incident.scope,
        opened_at=incident.opened_at,
        closed_at=incident.closed_at,
        status=incident.status,
        classification=incident.classification,
        action=incident.action,
        rule=incident.rule,
        jobs=incident.jobs or [],
        repair_s=_seconds(incident.opened_at, incident.closed_at) if closed else None,
        first_action_s=_seconds(first_event, first_action),
    )


def _counts(values: Iterable[str | None]) -> list[Count]:
    counted = Counter(values)
    ordered = sorted(counted.items(), key=lambda item: (-item[1], item[0] or ""))
    return [Count(value=value, incidents=n) for value, n in ordered]


def nearest_rank(ordered: list[float], q: float) -> float:
    """The smallest value with at least a fraction `q` of the values at or below it."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def distribution(values: Iterable[float | None]) -> Distribution:
    ordered = sorted(v for v in values if v is not None)
    p50, p90, p99 = (nearest_rank(ordered, q) if ordered else None for q in PERCENTILES)
    edges = [*HISTOGRAM_EDGES_S, math.inf]
    return Distribution(
        incidents=len(ordered),
        p50_s=p50,
        p90_s=p90,
        p99_s=p99,
        max_s=ordered[-1] if ordered else None,
        histogram=[
            Bin(
                from_s=low,
                to_s=None if high == math.inf else high,
                incidents=sum(low <= v < high for v in ordered),
            )
            for low, high in itertools.pairwise(edges)
        ],
    )


def _goodput_lost(costs: list[IncidentCost]) -> list[JobLoss]:
    per_job: defaultdict[str, list[IncidentCost]] = defaultdict(list)
    for cost in costs:
        per_job[cost.job].append(cost)
    totals = [job_goodput(mine) for mine in per_job.values()]
    losses = [
        JobLoss(
            job=t.job,
            failures=t.failures,
            detection_s=t.detection_s,
            recovery_s=t.recovery_s,
            lost_work_s=t.lost_work_s,
            downtime_s=t.downtime_s,
        )
        for t in totals
    ]
    return sorted(losses, key=lambda loss: (-loss.downtime_s, loss.job))


def _answer(approval: ApprovalRecord) -> Answer:
    if approval.answered_at is None:
        return "pending"
    if approval.approved is None:
        return "timed out"
    return "approved" if approval.approved else "denied"


def _approval(approval: ApprovalRecord, node: str | None) -> Approval:
    return Approval(
        incident=approval.incident_id,
        node=node,
        action=approval.action,
        requested_at=approval.requested_at,
        answered_at=approval.answered_at,
        answer=_answer(approval),
        by=approval.by,
        via=approval.via,
        wait_s=_seconds(approval.requested_at, approval.answered_at),
    )


def _approvers(approvals: list[ApprovalRecord]) -> list[Approver]:
    answers: defaultdict[str, Counter[bool]] = defaultdict(Counter)
    for a in approvals:
        if a.by is not None and a.approved is not None:
            answers[a.by][a.approved] += 1
    return [Approver(by=by, approved=n[True], denied=n[False]) for by, n in sorted(answers.items())]


def csv_tables(report: Report) -> dict[str, tuple[list[str], list[list[Any]]]]:
    """The report as tables, by file stem: each list of the JSON under its key, the two
    distributions in `distributions` and their bins in `histograms`. Headers are the fields,
    so an empty table still has its header."""
    tables: dict[str, tuple[list[str], list[list[Any]]]] = {}
    for key, field in Report.model_fields.items():
        model = _item_model(field.annotation)
        if model is not None:
            items: list[BaseModel] = getattr(report, key)
            tables[key] = (list(model.model_fields), [_cells(item) for item in items])
    measures = {"mttr": report.mttr, "time_to_first_action": report.time_to_first_action}
    stats = [name for name in Distribution.model_fields if name != "histogram"]
    tables["distributions"] = (
        ["measure", *stats],
        [[measure, *(getattr(d, s) for s in stats)] for measure, d in measures.items()],
    )
    tables["histograms"] = (
        ["measure", *Bin.model_fields],
        [[measure, *_cells(b)] for measure, d in measures.items() for b in d.histogram],
    )
    return tables


def _item_model(annotation: Any) -> type[BaseModel] | None:
    args = getattr(annotation, "__args__", ())
    if getattr(annotation, "__origin__", None) is list and args and issubclass(args[0], BaseModel):
        model: type[BaseModel] = args[0]
        return model
    return None


def _cells(item: BaseModel) -> list[Any]:
    # A cell holds one value: lists (an incident's jobs) are joined by spaces, which names never hold.
    return [" ".join(v) if isinstance(v, list) else v for v in item.model_dump(mode="json").values()]
