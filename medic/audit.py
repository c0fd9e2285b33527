"""The audit of one incident as markdown: the Prefect artifact of its flow run reads as this."""

from __future__ import annotations

from medic.artifacts import step_artifacts
from medic.store import IncidentDetail


def _seconds(detail: IncidentDetail) -> float:
    steps = detail.steps
    return sum((s.finished_at - s.started_at).total_seconds() for s in steps)


def incident_markdown(detail: IncidentDetail) -> str:
    inc = detail.incident
    lines = [
        f"# Incident {inc.id} on {inc.node}",
        "",
        f"- **Status:** {inc.status}  ",
        f"- **Classification:** {inc.classification or '-'}  ",
        f"- **Action:** {inc.action or '-'} (rule `{inc.rule or '-'}`)  ",
        f"- **Jobs:** {', '.join(inc.jobs or []) or '-'}; **owner:** {inc.owner or '-'}  ",
        f"- **Opened:** {inc.opened_at.isoformat()}; **closed:** {inc.closed_at.isoformat() if inc.closed_at else '-'}",
        "",
        "## Evidence",
        "",
        "| time | kind | node | gpu | job | details |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for e in detail.events:
        attrs = ", ".join(f"{k}={v}" for k, v in (e.attributes or {}).items())
        lines.append(
            f"| {e.time:%H:%M:%S} | {e.kind} | {e.node} | {e.gpu if e.gpu is not None else ''} "
            f"| {e.job or ''} | {attrs} |"
        )
    lines += ["", "## Decisions", ""]
    for d in detail.decisions:
        action = f"{d.action} L{d.diagnose_level}" if d.diagnose_level else d.action
        mode = f" in {d.mode_said()}" if d.mode_said() else ""
        lines.append(
            f"- {d.decided_at:%H:%M:%S} **{action}**{mode} ({d.classification}) by rule `{d.rule}` — {d.reason} "
            f"(policy `{d.policy_path}` sha256 `{d.policy_sha256[:12]}`)"
        )
    lines += ["", "## Actions", ""]
    if not detail.actions:
        lines.append("- none: the node was not touched")
    for a in detail.actions:
        lines.append(f"- {a.action} on {a.node}: **{a.status}** {a.detail}")
    kept = step_artifacts(s.detail for s in detail.steps)
    if kept:
        lines += ["", "## Evidence files", ""]
        lines += [f"- {a.what}: `{a.path}`" for a in kept]
    if detail.diagnostics:
        lines += [
            "",
            "## Diagnostics",
            "",
            "| level | result | errors | detail |",
            "| --- | --- | --- | --- |",
        ]
        for g in detail.diagnostics:
            lines.append(f"| {g.level} | {g.result} | {', '.join(g.error_ids or [])} | {g.detail} |")
    lines += [
        "",
        "## Stages",
        "",
        "| stage | status | seconds | what happened |",
        "| --- | --- | --- | --- |",
    ]
    for s in detail.steps:
        took = (s.finished_at - s.started_at).total_seconds()
        lines.append(f"| {s.stage} | {s.status} | {took:.3f} | {s.summary} |")
    lines += ["", f"**Outcome:** {inc.outcome or '-'}  ", f"**Time in stages:** {_seconds(detail):.2f} s", ""]
    return "\n".join(lines)
