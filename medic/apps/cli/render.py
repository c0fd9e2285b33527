"""Rich views of incidents, decisions and messages for the terminal."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from medic.intake import Rejection
from medic.protocols import Message

if TYPE_CHECKING:  # the store's types, not its modules: `medic triage` runs without SQLAlchemy
    from medic.store import IncidentDetail
    from medic.store.tables import IncidentRecord

ACTION_STYLE = {
    "replace": "bold red",
    "reboot": "red",
    "reset_gpu": "yellow",
    "diagnose": "cyan",
    "drain": "magenta",
    "escalate": "bold magenta",
    "reintegrate": "green",
    "none": "dim",
}


def action_text(action: str | None) -> Text:
    return Text(action or "-", style=ACTION_STYLE.get(action or "", ""))


def rejections_table(rejections: Iterable[Rejection]) -> Table:
    table = Table(title="Rejected input (kept in the dead-letter table)", title_justify="left")
    table.add_column("where")
    table.add_column("why", overflow="fold")
    for r in rejections:
        table.add_row(r.origin, r.reason)
    return table


def incidents_table(rows: Iterable[IncidentRecord], title: str = "Incidents") -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("incident", "node", "opened", "status", "class", "action", "rule", "jobs", "owner"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r.id,
            r.node,
            f"{r.opened_at:%Y-%m-%d %H:%M:%S}",
            r.status,
            r.classification or "-",
            action_text(r.action),
            r.rule or "-",
            ", ".join(r.jobs or []),
            r.owner or "-",
        )
    return table


def subject(incident: IncidentRecord) -> str:
    return f"switch {incident.node}" if incident.scope == "switch" else incident.node


def stages_table(detail: IncidentDetail) -> Table:
    table = Table(title=f"{detail.incident.id} on {subject(detail.incident)}: stages", title_justify="left")
    for column in ("stage", "status", "seconds", "what happened"):
        table.add_column(column, overflow="fold")
    for s in detail.steps:
        took = (s.finished_at - s.started_at).total_seconds()
        style = {"failed": "red", "skipped": "dim"}.get(s.status, "")
        table.add_row(s.stage, Text(s.status, style=style), f"{took:.3f}", s.summary)
    return table


def incident_view(detail: IncidentDetail) -> Group:
    inc = detail.incident
    head = Table.grid(padding=(0, 2))
    head.add_row("status", inc.status)
    head.add_row("classification", inc.classification or "-")
    head.add_row("action", action_text(inc.action))
    head.add_row("rule", inc.rule or "-")
    head.add_row("jobs / owner", f"{', '.join(inc.jobs or []) or '-'} / {inc.owner or '-'}")
    head.add_row("flow run", inc.flow_run_name or "-")
    head.add_row("outcome", inc.outcome or "-")
    events = Table(title="Evidence", title_justify="left")
    for column in ("time", "kind", "node", "gpu", "job", "attributes"):
        events.add_column(column, overflow="fold")
    for e in detail.events:
        attrs = ", ".join(f"{k}={v}" for k, v in (e.attributes or {}).items())
        events.add_row(
            f"{e.time:%H:%M:%S}", e.kind, e.node, "" if e.gpu is None else str(e.gpu), e.job or "", attrs
        )
    decisions = Table(title="Decisions", title_justify="left")
    for column in ("at", "action", "rule", "reason", "policy"):
        decisions.add_column(column, overflow="fold")
    for d in detail.decisions:
        action = action_text(d.action)
        if d.mode_said():
            action.append(f" ({d.mode_said()})", style="dim")
        decisions.add_row(f"{d.decided_at:%H:%M:%S}", action, d.rule, d.reason, d.policy_sha256[:12])
    actions = Table(title="Actions (intent → outcome)", title_justify="left")
    for column in ("action", "node", "status", "detail"):
        actions.add_column(column, overflow="fold")
    for a in detail.actions:
        actions.add_row(a.action, a.node, a.status, a.detail)
    return Group(
        Panel(head, title=f"Incident {inc.id} on {subject(inc)}"),
        events,
        decisions,
        actions,
        stages_table(detail),
    )


def message_panel(message: Message, replies: list[str]) -> Panel:
    body = Text()
    body.append(f"{message.title}\n", style="bold")
    body.append(f"{message.body}\n")
    facts = " · ".join(f"{k}: {v}" for k, v in message.fields.items() if v)
    if facts:
        body.append(f"{facts}\n", style="dim")
    if message.recommend:
        body.append("Recommended:\n", style="bold")
        for item in message.recommend:
            body.append(f"  • {item}\n")
    if message.artifacts:  # a slow rank's profile and its peer's, a hung rank's stack dump
        body.append("Files:\n", style="bold")
        for artifact in message.artifacts:
            body.append(f"  • {artifact.what}: {artifact.path}\n")
    for reply in replies:
        body.append(f"  ↳ {reply}\n", style="italic")
    return Panel(body, title=f"Slack → {message.channel} (not sent: no token)", title_align="left")


def print_all(console: Console, *renderables: object) -> None:
    for item in renderables:
        console.print(item)
