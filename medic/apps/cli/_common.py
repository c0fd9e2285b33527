"""What the command modules share: the consoles, the option types, loading the policy."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from medic.config import load_settings
from medic.intake import Intake
from medic.policy import LoadedPolicy, PolicyError, load_policy

if TYPE_CHECKING:
    from medic.tasks.runtime.process import Runtime

console = Console()
err = Console(stderr=True, soft_wrap=True)  # diagnostics stay one grep-able file:line line each

PolicyOption = Annotated[
    Path | None,
    typer.Option("--policy", "-p", help="Policy file (default: $MEDIC_POLICY or policies/default.yaml)."),
]
EventsArgument = Annotated[
    Path, typer.Argument(help="Events, one JSON object per line.", exists=True, dir_okay=False)
]


def load_policy_or_exit(path: Path | None) -> LoadedPolicy:
    try:
        return load_policy(path or load_settings().policy_path)
    except PolicyError as error:
        err.print(f"[red]policy error[/red]\n{error}")
        raise typer.Exit(2) from None


def report_rejections(intake: Intake) -> None:
    for rejection in intake.rejected:
        err.print(f"[yellow]rejected[/yellow] {escape(str(rejection))}")
    if intake.duplicates:
        err.print(f"[dim]ignored {len(intake.duplicates)} repeated event ids[/dim]")


def runtime_or_exit(policy: Path | None) -> Runtime:
    """The store, the configured backends and the policy, installed for the flows; exit 2 with what to
    set when a backend is not configured or the policy does not load."""
    # Imported here: the commands that run no flow start without the backends' modules.
    from medic.integrations.registry import BackendError, from_settings
    from medic.store import Store
    from medic.tasks.runtime.process import Runtime, configure

    settings = load_settings()
    loaded = load_policy_or_exit(policy)
    try:
        backends = from_settings(settings)
    except BackendError as error:  # not configured, or configured wrong: say what to set
        err.print(f"[red]error:[/red] {escape(str(error))}")
        raise typer.Exit(2) from None
    return configure(
        Runtime(Store(settings.database_url), backends, Path(loaded.path), settings.artifact_root)
    )


def parse_since(value: str | None) -> datetime | None:
    """A `--since` option: an RFC 3339 time (UTC unless it says), or a span back from now (30m, 6h, 7d)."""
    if not value:
        return None
    units = {"m": "minutes", "h": "hours", "d": "days"}
    if value[-1] in units and value[:-1].isdigit():
        return datetime.now(UTC) - timedelta(**{units[value[-1]]: int(value[:-1])})
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter("use an RFC 3339 time or a span like 30m, 6h, 7d") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
