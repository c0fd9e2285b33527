"""`medic node ...`: put what runs on a GPU node in place from the installed package, no checkout.

The Slurm hook scripts and the systemd units ship inside the wheel (medic/slurm_hooks, medic/systemd);
these commands copy them where Slurm and systemd read them, pointing them at this installation's
commands (docs/install.md).
"""

from __future__ import annotations

import shlex
import sysconfig
from pathlib import Path
from typing import Annotated

import typer

from medic.apps.cli._common import console
from medic.apps.cli.held import held_command
from medic.shipped import SLURM_HOOKS, SYSTEMD_UNITS

node_app = typer.Typer(
    help="Install the node's Slurm hooks and the systemd units; list the nodes GPU Medic holds.",
    no_args_is_help=True,
)
node_app.command("held")(held_command)

HOOKS_ENV = "medic-hooks.env"


def _bin() -> Path:
    """The folder of this installation's commands (`medic`, `medic-slurm-hook`, `prefect`)."""
    return Path(sysconfig.get_path("scripts"))


def _say(message: str) -> None:
    console.print(message, markup=False, highlight=False)


@node_app.command("install-hooks")
def install_hooks(
    directory: Annotated[
        Path, typer.Argument(help="Where slurm.conf's Prolog/Epilog/HealthCheckProgram point.")
    ],
) -> None:
    """Write the Slurm Prolog, Epilog and HealthCheckProgram scripts, calling this installation.

    A new medic-hooks.env names this installation's commands (MEDIC_BIN); an existing one is kept as
    it is (it holds the site's token and settings).
    """
    directory.mkdir(parents=True, exist_ok=True)
    for script in sorted(SLURM_HOOKS.glob("medic-*.sh")):
        target = directory / script.name
        target.write_bytes(script.read_bytes())
        target.chmod(0o755)
        _say(f"wrote {target}")
    settings = directory / HOOKS_ENV
    if settings.exists():
        _say(f"kept {settings} (MEDIC_BIN there says which installation runs)")
        return
    settings.write_text(
        "# GPU Medic's Slurm hooks (docs/agent.md): shell syntax, KEY=value; root-only, it holds the token.\n"
        f"MEDIC_BIN={shlex.quote(str(_bin()))}\n"
        "# MEDIC_URL=https://medic.example:8787\n# MEDIC_TOKEN=\n# MEDIC_PROLOG_FAIL_CLOSED=1\n",
        encoding="utf-8",
    )
    settings.chmod(0o600)
    _say(f"wrote {settings}")


@node_app.command("install-units")
def install_units(
    directory: Annotated[Path, typer.Argument(help="systemd's unit folder, e.g. /etc/systemd/system.")],
) -> None:
    """Write the systemd units (the agent, `medic serve`, a Prefect worker) for this installation.

    Enable the ones the machine runs: `systemctl enable --now medic-agent` on a GPU node.
    """
    directory.mkdir(parents=True, exist_ok=True)
    commands = str(_bin())
    for unit in sorted(SYSTEMD_UNITS.glob("*.service")):
        target = directory / unit.name
        target.write_text(unit.read_text(encoding="utf-8").replace("@BIN@", commands), encoding="utf-8")
        _say(f"wrote {target}")
