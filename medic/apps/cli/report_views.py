"""The report's tables as people read them (durations in a person's units), shared by the terminal
summary and the HTML page of `medic report`, so that both show the same figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from medic.advise import human_seconds
from medic.report import Bin, Count, Distribution, Report

TOP = 10  # rows of the node, GPU and rule rankings shown; the JSON and CSV hold them all


@dataclass(frozen=True, slots=True)
class View:
    title: str
    headers: list[str]
    rows: list[list[str]]
    numeric: frozenset[int] = field(default_factory=frozenset)  # columns aligned right


def duration(seconds: float | None) -> str:
    return "-" if seconds is None else human_seconds(seconds)


def when(at: datetime | None) -> str:
    return "-" if at is None else f"{at:%Y-%m-%d %H:%M:%S}"


def value(count: Count) -> str:
    return count.value or "undecided"


def _edge(seconds: float) -> str:
    for unit, size in (("d", 86_400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


def bin_label(b: Bin) -> str:
    return f"≥ {_edge(b.from_s)}" if b.to_s is None else f"< {_edge(b.to_s)}"


def window(report: Report) -> str:
    return f"opened since {when(report.since)} UTC" if report.since else "all in the store"


def measures(report: Report) -> list[tuple[str, Distribution]]:
    return [("MTTR", report.mttr), ("time to first action", report.time_to_first_action)]


def counts(report: Report) -> list[View]:
    by = {
        "status": report.by_status,
        "classification": report.by_classification,
        "action": report.by_action,
        "rule": report.by_rule,
    }
    return [
        View(f"by {name}", [name, "incidents"], [[value(c), str(c.incidents)] for c in found], frozenset({1}))
        for name, found in by.items()
    ]


def durations(report: Report) -> View:
    return View(
        "MTTR and time to first action",
        ["", "incidents", "p50", "p90", "p99", "max"],
        [
            [name, str(d.incidents), *(duration(s) for s in (d.p50_s, d.p90_s, d.p99_s, d.max_s))]
            for name, d in measures(report)
        ],
        frozenset(range(1, 6)),
    )


def histograms(report: Report) -> View:
    named = measures(report)
    return View(
        "Incidents per duration",
        ["", *(name for name, _ in named)],
        [
            [bin_label(b), *(str(d.histogram[i].incidents) for _, d in named)]
            for i, b in enumerate(report.mttr.histogram)
        ],
        frozenset(range(1, len(named) + 1)),
    )


def nodes(report: Report) -> View:
    return View(
        f"Nodes with the most incidents (top {TOP})",
        ["node", "incidents"],
        [[n.node, str(n.incidents)] for n in report.nodes[:TOP]],
        frozenset({1}),
    )


def gpus(report: Report) -> View:
    return View(
        f"GPUs with the most incidents (top {TOP})",
        ["node", "GPU", "incidents"],
        [[g.node, str(g.gpu), str(g.incidents)] for g in report.gpus[:TOP]],
        frozenset({1, 2}),
    )


def goodput(report: Report) -> View:
    return View(
        "Goodput lost per job (downtime = detection + recovery)",
        ["job", "failures", "detection", "recovery", "downtime", "lost work"],
        [
            [
                j.job,
                str(j.failures),
                *(duration(s) for s in (j.detection_s, j.recovery_s, j.downtime_s, j.lost_work_s)),
            ]
            for j in report.goodput_lost
        ],
        frozenset(range(1, 6)),
    )


def approvals(report: Report) -> View:
    return View(
        "Approval requests",
        ["incident", "node", "action", "requested", "answer", "by", "via", "waited"],
        [
            [
                a.incident,
                a.node or "-",
                a.action,
                when(a.requested_at),
                a.answer,
                a.by or "-",
                a.via or "-",
                duration(a.wait_s),
            ]
            for a in report.approvals
        ],
        frozenset({7}),
    )


def approvers(report: Report) -> View:
    return View(
        "Who answered",
        ["by", "approved", "denied"],
        [[a.by, str(a.approved), str(a.denied)] for a in report.approvers],
        frozenset({1, 2}),
    )


def held(report: Report) -> View:
    return View(
        "Nodes GPU Medic holds out of service now",
        ["node", "incident", "action", "since", "incident status", "why"],
        [
            [h.node, h.incident, h.action, when(h.since), h.incident_status or "-", h.outcome or "-"]
            for h in report.held
        ],
    )


def incidents(report: Report) -> View:
    return View(
        "Every incident in the window",
        ["incident", "node", "opened", "status", "class", "action", "rule", "jobs", "repair", "first action"],
        [
            [
                i.id,
                i.node,
                when(i.opened_at),
                i.status,
                i.classification or "-",
                i.action or "-",
                i.rule or "-",
                ", ".join(i.jobs) or "-",
                duration(i.repair_s),
                duration(i.first_action_s),
            ]
            for i in report.incidents
        ],
        frozenset({8, 9}),
    )
