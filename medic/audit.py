"""The audit of one incident as markdown: the Prefect artifact of its flow run reads as this."""

from __future__ import annotations

from medic.artifacts import step_artifacts
from medic.facts import TOP_EVIDENCE, StragglerVerdict, straggler_verdict
from medic.store import IncidentDetail


def _seconds(detail: IncidentDetail) -> float:
    steps = detail.steps
    return sum((s.finished_at - s.started_at).total_seconds() for s in steps)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a pipe would end the table's cell


def _verdict(verdict: StragglerVerdict) -> list[str]:
    """Why the straggler is slow (docs/culprit.md): the verdict, both traces, and what grew most."""
    where = f" in `{verdict.where}`" if verdict.where else ""
    lines = [
        "",
        "## Why the straggler is slow",
        "",
        f"**{verdict.cause.value}** (confidence {verdict.confidence:.2f}){where}  ",
        f"Traces: this rank `{verdict.artifact or '-'}`, a healthy peer `{verdict.peer_artifact or '-'}`",
    ]
    if verdict.evidence:
        lines += [
            "",
            "| grew on this rank | category | ms/step more | ratio to peer's |",
            "| --- | --- | --- | --- |",
        ]
        for row in verdict.evidence[:TOP_EVIDENCE]:
            ratio = f"{row.ratio:.1f}" if row.ratio is not None else "-"
            lines.append(f"| {_cell(row.name)} | {row.category} | +{row.grew_s * 1000:.1f} | {ratio} |")
    return lines


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
    verdict = straggler_verdict(detail.events)
    if verdict is not None:
        lines += _verdict(verdict)
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
