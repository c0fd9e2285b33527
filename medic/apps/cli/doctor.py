"""`medic doctor`: the resolved configuration, then every backend it needs probed for real.

The probes live in medic/integrations/probes.py; this module only resolves and prints (docs/cli.md).
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Annotated, Any

import typer

from medic.apps.cli._common import err
from medic.config import BACKENDS_VAR, Choice, Settings, load_settings
from medic.integrations import registry
from medic.integrations.probes import Probe, masked_url, probe_all, versions
from medic.policy import PolicyError


def _sha256(settings: Settings) -> str | None:
    try:
        return hashlib.sha256(settings.policy_path.read_bytes()).hexdigest()
    except OSError:
        return None


def resolved(settings: Settings) -> dict[str, Any]:
    """The configuration as `medic doctor --json` prints it (the password masked)."""
    return {
        "config_file": str(settings.config_path) if settings.config_path else None,
        "cluster": settings.cluster,
        "home": str(settings.home),
        "store": masked_url(settings.database_url),
        "policy": {"path": str(settings.policy_path), "sha256": _sha256(settings)},
        "backends": {
            role: {"value": c.value, "source": c.source, "variable": c.variable}
            for role, c in settings.backends.items()
        },
        "versions": versions(settings.env),
    }


def _configuration_errors(settings: Settings) -> list[str]:
    """Build the backends as `ingest` and `serve` would: what stops them is a configuration error."""
    try:
        registry.from_settings(settings)
    except registry.BackendError as error:
        return [str(error)]
    return []


def _describe(choice: Choice) -> str:
    if choice.value is None:
        return f"not configured: set {registry.HINTS[choice.role]} (or {BACKENDS_VAR}=sim)"
    return choice.describe()


def _print_text(config: dict[str, Any], settings: Settings, probes: list[Probe], errors: list[str]) -> None:
    out = sys.stdout.write
    out("Configuration\n")
    where = config["config_file"] or f"none ({settings.home / 'config.yaml'} does not exist)"
    rows = [
        ("config file", where + (f", cluster {config['cluster']}" if config["cluster"] else "")),
        ("store", config["store"]),
        ("policy", f"{config['policy']['path']} (sha256 {config['policy']['sha256'] or 'unreadable'})"),
        *((role, _describe(choice)) for role, choice in settings.backends.items()),
    ]
    for name, value in rows:
        out(f"  {name:<12} {value}\n")
    out("\nVersions\n")
    for name, value in config["versions"].items():
        out(f"  {name:<12} {value}\n")
    out("\nProbes\n")
    for probe in probes:
        out(probe.line() + "\n")
    for problem in errors:
        err.print(f"error: {problem}", markup=False, highlight=False)


def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of text.")] = False,
    node: Annotated[
        str | None,
        typer.Option(
            help="Node to probe DCGM on (default: this machine for the local runner, else Slurm's first)."
        ),
    ] = None,
) -> None:
    """Print the resolved configuration and probe each backend it needs; exit 0 only if all answer."""
    try:
        settings = load_settings()
    except (PolicyError, ValueError) as error:  # the config file itself is broken
        err.print(f"error: {error}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    errors = _configuration_errors(settings)
    probes = probe_all(settings, node)
    failed = [p for p in probes if p.status == "fail"]
    code = 2 if errors else 1 if failed else 0
    config = resolved(settings)
    if as_json:
        document = {
            **config,
            "errors": errors,
            "probes": [p.as_json() for p in probes],
            "ok": code == 0,
            "exit_code": code,
        }
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        _print_text(config, settings, probes, errors)
        summary = (
            "configuration errors above"
            if errors
            else f"{len(failed)} of {len(probes)} probes failed"
            if failed
            else "everything needed answers"
        )
        sys.stdout.write(f"\n{summary}\n")
    raise typer.Exit(code)
