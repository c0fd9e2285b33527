"""`medic dcgm ...`: read saved `dcgmi diag -j` output (docs/dcgm.md)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from medic.apps.cli._common import PolicyOption, console, err
from medic.apps.cli.render import action_text
from medic.config import load_settings
from medic.events import FaultEvent
from medic.integrations.dcgm.parse import DcgmOutputError, DiagReport, Gap, Status, Verdict, parse_report
from medic.policy import LoadedPolicy, PolicyError, load_policy
from medic.policy.model import Decision
from medic.triage import triage

dcgm_app = typer.Typer(help="Read DCGM diagnostic output.", no_args_is_help=True)

STATUS_STYLE = {
    Status.FAIL: "bold red",
    Status.WARN: "yellow",
    Status.PASS: "green",
    Status.SKIP: "dim",
    Status.NOT_RUN: "dim",
}


def _fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {escape(message)}")
    return typer.Exit(2)


def _read(file: Path) -> tuple[str, str]:
    """The text and the node it is about: the file's name, or "node" for standard input."""
    if str(file) == "-":
        return sys.stdin.read(), "node"
    try:
        return file.read_text(encoding="utf-8", errors="replace"), file.stem[:200] or "node"
    except OSError as error:
        raise _fail(f"{file}: {error.strerror or error}") from None


def _decide(report: DiagReport, verdict: Verdict, node: str, level: int, loaded: LoadedPolicy) -> Decision:
    """What the policy decides for an incident holding just this diagnostic (node in service)."""
    event = FaultEvent(
        id=f"dcgm-explain-l{level}",  # the incident id still differs per node: it hashes both
        time=datetime.now(UTC),
        source="dcgmi",
        kind="diagnostic",
        node=node,
        attributes={"level": level, "result": verdict.value, "error_ids": list(report.error_ids)},
    )
    [(_, decision)] = triage([event], loaded)
    return decision


def _entities_table(report: DiagReport) -> Table:
    table = Table(title_justify="left")
    for column in ("entity", "status", "test", "error", "DCGM severity", "category", "message"):
        table.add_column(column, overflow="fold")
    for entity in report.entities():
        name, status = f"{entity.group} {entity.entity_id}", entity.status
        styled = f"[{STATUS_STYLE[status]}]{status.value}[/]"
        if not entity.findings:
            table.add_row(name, styled, "", "", "", "", "")
        for finding in entity.findings:
            table.add_row(
                name,
                styled,
                finding.test,
                finding.name if finding.error_id is None else f"{finding.name} ({finding.error_id})",
                finding.severity.value,
                finding.category,
                escape(finding.message),
            )
    return table


def _gaps_table(gaps: tuple[Gap, ...]) -> Table:
    table = Table(title="Skipped or not run", title_justify="left")
    for column in ("test", "level", "status", "where", "reason"):
        table.add_column(column, overflow="fold")
    for gap in gaps:
        table.add_row(
            escape(gap.test),
            str(gap.level or "?"),
            gap.status,
            escape(", ".join(gap.where) or "every entity"),
            escape(gap.reason),
        )
    return table


@dataclass(frozen=True, slots=True)
class Explained:
    file: Path
    node: str
    level: int | None
    report: DiagReport
    verdict: Verdict  # judged at `level`
    reason: str
    gaps: tuple[Gap, ...]  # what a run of `level` left out
    loaded: LoadedPolicy
    decision: Decision | None  # None when the run gave no verdict


def _print(x: Explained) -> None:
    report, loaded, decision = x.report, x.loaded, x.decision
    versions = f"DCGM {report.dcgm_version or '?'}, driver {report.driver_version or '?'}"
    console.print(
        f"[bold]{escape(str(x.file))}[/bold] (node {escape(x.node)}): level {x.level or '?'}, {versions}"
    )
    if report.tests:
        console.print(_entities_table(report))
    if x.gaps:
        console.print(_gaps_table(x.gaps))
    console.print(f"Verdict: [bold]{x.verdict.value.upper()}[/bold], {escape(x.reason)}")
    if report.error_ids:
        worst = report.worst_severity.value if report.worst_severity else "-"
        console.print(f"Failing errors: {', '.join(report.error_ids)}; worst DCGM severity {worst}")
    if decision is None:
        why = (
            "the run left tests out, so there is no verdict about the GPUs; never a pass (the flow escalates)"
            if x.verdict is Verdict.INCOMPLETE
            else "DCGM did not run, so there is no verdict about the GPUs (the flow escalates)"
        )
        console.print(f"Decision: none; {why}")
        return
    console.print(
        f"Decision ({escape(loaded.path)}, {loaded.sha256[:12]}): ",
        action_text(decision.action.value),
        f" ({decision.classification.value}) by rule {decision.rule}: {escape(decision.reason)}",
        sep="",
    )
    for line in decision.recommend:
        console.print(f"  • {escape(line)}")


def _as_json(x: Explained) -> dict[str, Any]:
    report = x.report
    return {
        "file": str(x.file),
        "node": x.node,
        "level": x.level,
        "dcgm_version": report.dcgm_version,
        "driver_version": report.driver_version,
        "verdict": x.verdict.value,
        "reason": x.reason,
        "skipped": [asdict(g) for g in x.gaps],
        "error_ids": list(report.error_ids),
        "worst_severity": report.worst_severity.value if report.worst_severity else None,
        "entities": [asdict(e) for e in report.entities()],
        "policy": {"path": x.loaded.path, "sha256": x.loaded.sha256},
        "decision": x.decision.model_dump(mode="json") if x.decision else None,
    }


@dcgm_app.command("explain")
def explain(
    file: Annotated[
        Path, typer.Argument(help="Saved output of `dcgmi diag -r N -j`; - reads standard input.")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of tables.")] = False,
    policy: PolicyOption = None,
    level: Annotated[
        int | None,
        typer.Option(
            min=1, max=4, help="The -r level it was run at (default: read from the tests that ran)."
        ),
    ] = None,
) -> None:
    """The verdict per GPU, each error's DCGM severity and category, the tests skipped or not run
    and why, and the policy's decision."""
    text, node = _read(file)
    try:
        report = parse_report(text)
    except DcgmOutputError as error:
        raise _fail(f"{file}: not usable dcgmi diag output: {error}") from None
    try:
        loaded = load_policy(policy or load_settings().policy_path)
    except PolicyError as error:
        raise _fail(f"policy error\n{error}") from None
    level = level or report.level
    verdict, reason = report.judge(level)
    decision = None
    if verdict in (Verdict.PASS, Verdict.FAIL):
        if level is None:
            raise _fail(
                f"{file}: no test tells the level ({', '.join(t.name for t in report.tests)}); pass --level"
            )
        decision = _decide(report, verdict, node, level, loaded)
    gaps = report.gaps(level) if report.tests else ()
    explained = Explained(file, node, level, report, verdict, reason, gaps, loaded, decision)
    if as_json:
        sys.stdout.write(json.dumps(_as_json(explained)) + "\n")
    else:
        _print(explained)
