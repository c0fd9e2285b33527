"""`medic audit ...`: the store's tamper-evident chain (verify) and its retention (prune)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from medic.apps.cli._common import console, err, parse_since
from medic.config import load_settings
from medic.store import Store
from medic.store.archive import ArchiveCheck, read_archive, verify_archive
from medic.store.chain import Problem
from medic.store.prune import PruneRefused
from medic.store.tables import AuditPruneRecord
from medic.store.verify import Verification

audit_app = typer.Typer(
    help="The audit chain: verify the store or an archive, prune into signed archives.", no_args_is_help=True
)
SHOWN = 20  # problems listed; the count says how many more


@audit_app.command("verify")
def audit_verify(
    since: Annotated[
        str | None,
        typer.Option(help="Only the entries written since: RFC 3339 time or a span (30m, 6h, 7d)."),
    ] = None,
    archive: Annotated[
        Path | None,
        typer.Option(help="Check this archive of `medic audit prune` instead.", exists=True, dir_okay=False),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Walk the audit chain and check every audited row against it; name the first broken link.

    Exit status 0: it holds; 1: it is broken (where, on standard error)."""
    store = Store(load_settings().database_url)
    if archive is not None:
        _verify_archive(store, archive, as_json)
        return
    result = store.verify_chain(since=parse_since(since))
    if as_json:
        sys.stdout.write(json.dumps(_verification_json(result)) + "\n")
    elif result.ok:
        head = f"head seq {result.head.seq} ({result.head.hash[:12]})" if result.head else "no entries"
        console.print(
            f"ok: {result.entries} entries, {result.rows} rows checked, {result.pruned} pruned entries linked "
            f"across; {head}",
            markup=False,
        )
    if result.unchecked and not as_json:
        err.print(
            f"note: {result.unchecked} entries are keyed and MEDIC_AUDIT_KEY is not set: their links and rows "
            "were checked, their hashes were not",
            markup=False,
        )
    if not result.ok:
        _report_problems(result.problems, as_json)
        raise typer.Exit(1)


@audit_app.command("prune")
def audit_prune(
    before: Annotated[
        str, typer.Option(help="Prune incidents that ended before: RFC 3339 time, a date, or a span (90d).")
    ],
    archive: Annotated[
        Path, typer.Option(help="The archive to write first; must not exist.", dir_okay=False)
    ],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Archive, then remove, the incidents no longer active that ended before a date, with all their
    rows and ledger entries. Active incidents are never pruned.

    Exit status 0: pruned (or nothing to prune) and the chain verifies; 1: refused or broken."""
    if archive.exists():
        err.print(f"[red]error:[/red] {escape(str(archive))} exists: an archive is never overwritten")
        raise typer.Exit(2)
    cutoff = parse_since(before)
    if cutoff is None:
        raise typer.BadParameter("give an RFC 3339 time, a date or a span like 90d", param_hint="--before")
    try:
        pruned = Store(load_settings().database_url).prune(cutoff, archive)
    except PruneRefused as error:
        err.print(f"[red]refused:[/red] {escape(str(error))}")
        raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(
            json.dumps(
                {
                    "incidents": pruned.incidents,
                    "rows": pruned.rows,
                    "entries": pruned.entries,
                    "kept_active": pruned.kept_active,
                    "archive": str(archive) if pruned.archive_sha256 else None,
                    "archive_sha256": pruned.archive_sha256,
                    "after": _verification_json(pruned.after) if pruned.after else None,
                }
            )
            + "\n"
        )
    elif pruned.archive_sha256 is None:
        console.print(
            f"nothing to prune: no incident that is no longer active ended before {cutoff.isoformat()}"
        )
    else:
        console.print(
            f"archived {pruned.incidents} incidents ({pruned.rows} rows, {pruned.entries} ledger entries) to "
            f"{archive} (sha256 {pruned.archive_sha256}), then removed them",
            markup=False,
        )
    if pruned.kept_active and not as_json:
        console.print(
            f"kept {pruned.kept_active} incidents still active that began before {cutoff.isoformat()}"
        )
    if pruned.after is not None and not pruned.after.ok:
        _report_problems(pruned.after.problems, as_json)
        raise typer.Exit(1)


def _verify_archive(store: Store, path: Path, as_json: bool) -> None:
    try:
        archive = read_archive(path)
    except (OSError, ValueError) as error:
        err.print(f"[red]broken:[/red] {escape(str(error))}")
        raise typer.Exit(1) from None
    check = verify_archive(archive, store.audit_key)
    record = store.prune_record(archive.sha256)
    problems = list(check.problems)
    if record is not None and (
        record.runs != [r.as_list() for r in archive.runs] or record.entries != len(archive.entries)
    ):
        problems.append(
            Problem(None, None, None, None, f"it differs from the store's record of prune {record.id}")
        )
    if as_json:
        sys.stdout.write(json.dumps(_archive_json(archive.sha256, check, record, problems)) + "\n")
    elif not problems:
        recorded = (
            f"recorded in the store as prune {record.id} of {record.pruned_at:%Y-%m-%d %H:%M:%S}"
            if record is not None
            else "this store has no record of it"
        )
        signed = (
            "HMAC-SHA256 with MEDIC_AUDIT_KEY" if check.keyed else "sha256 (no key to check a signature with)"
        )
        console.print(
            f"ok: {path}: {len(archive.rows)} rows, {len(archive.entries)} ledger entries of "
            f"{len(archive.header.get('incidents', []))} incidents; signature {signed}; {recorded}",
            markup=False,
        )
    if problems:
        _report_problems(problems, as_json)
        raise typer.Exit(1)


def _report_problems(problems: list[Problem], as_json: bool) -> None:
    if as_json:
        return  # the JSON has them
    err.print(f"broken at {problems[0].describe()}", markup=False, highlight=False)
    if len(problems) > 1:
        err.print(f"{len(problems)} problems in all:", markup=False)
        for problem in problems[:SHOWN]:
            err.print(f"  {problem.describe()}", markup=False, highlight=False)
        if len(problems) > SHOWN:
            err.print(f"  ... and {len(problems) - SHOWN} more", markup=False)


def _problem_json(problem: Problem) -> dict[str, Any]:
    return {
        "seq": problem.seq,
        "table": problem.table,
        "row_key": problem.row_key,
        "incident_id": problem.incident_id,
        "what": problem.what,
    }


def _verification_json(result: Verification) -> dict[str, Any]:
    return {
        "ok": result.ok,
        "entries": result.entries,
        "rows": result.rows,
        "pruned": result.pruned,
        "head": {"seq": result.head.seq, "hash": result.head.hash} if result.head else None,
        "unchecked": result.unchecked,
        "problems": [_problem_json(p) for p in result.problems],
    }


def _archive_json(
    sha256: str, check: ArchiveCheck, record: AuditPruneRecord | None, problems: list[Problem]
) -> dict[str, Any]:
    return {
        "ok": not problems,
        "sha256": sha256,
        "keyed": check.keyed,
        "prune": record.id if record is not None else None,
        "problems": [_problem_json(p) for p in problems],
    }
