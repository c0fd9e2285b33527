"""The `medic` command line (docs/cli.md): the root app; each command family has its own module.

`medic COMMAND` imports that command's module and no other: the families together pull in Prefect's
client, httpx, the report's HTML and the simulator, which would add a second to every command's start
(BENCHMARKS.md). The root's help, or a name that is no command, registers them all.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from functools import cache
from typing import Annotated, Any

import typer

from medic import __version__
from medic.apps.cli._common import err
from medic.integrations.backend_errors import BackendError
from medic.policy import PolicyError

# Each command or command family, as `medic --help` lists them (registration order), and where it lives.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("medic.apps.cli.serve", "serve"),
    "agent": ("medic.apps.cli.agent", "agent"),
    "emit": ("medic.apps.cli.serve", "emit"),
    "triage": ("medic.apps.cli.triage", "triage"),
    "ingest": ("medic.apps.cli.ingest", "ingest"),
    "incidents": ("medic.apps.cli.incidents", "incidents"),
    "incident": ("medic.apps.cli.incidents", "incident"),
    "demo": ("medic.apps.cli.demo", "demo"),
    "doctor": ("medic.apps.cli.doctor", "doctor"),
    "goodput": ("medic.apps.cli.goodput", "goodput"),
    "report": ("medic.apps.cli.report", "report"),
    "simulate": ("medic.apps.cli.simulate", "simulate"),
    "schema": ("medic.apps.cli.triage", "schema"),
    "policy": ("medic.apps.cli.policy", "policy_app"),
    "rollout": ("medic.apps.cli.rollout", "rollout_app"),
    "dcgm": ("medic.apps.cli.dcgm", "dcgm_app"),
    "advise": ("medic.apps.cli.advise", "advise_app"),
    "breaker": ("medic.apps.cli.breaker", "breaker_app"),
    "audit": ("medic.apps.cli.audit", "audit_app"),
    "check": ("medic.apps.cli.check", "check_app"),
    "fleet": ("medic.apps.cli.fleet", "fleet_app"),
    "sweep": ("medic.apps.cli.sweep", "sweep_app"),
    "node": ("medic.apps.cli.node", "node_app"),
    "alerts": ("medic.apps.cli.alerts", "alerts_app"),
}


def build(names: Iterable[str] = COMMANDS) -> typer.Typer:
    """The root app with these commands registered."""
    root = typer.Typer(
        name="medic",
        help="GPU Medic: automated fault remediation for GPU training clusters.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    # A root with a single command would run it without its name: the callback keeps `medic NAME`.
    root.callback()(_root)
    for name in names:
        module, attribute = COMMANDS[name]
        target = getattr(importlib.import_module(module), attribute)
        if isinstance(target, typer.Typer):
            root.add_typer(target, name=name)
        else:
            root.command(name=name)(target)
    return root


def _print_version(asked: bool) -> None:
    if asked:
        sys.stdout.write(f"gpu-medic {__version__}\n")
        raise typer.Exit()


def _root(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit."),
    ] = False,
) -> None:
    return None  # the help is the Typer's


@cache
def _whole() -> typer.Typer:
    return build()


def __getattr__(name: str) -> Any:
    # `app`: every command, built on first use (the tests' CliRunner and `typer apps.cli.app` use it).
    if name == "app":
        return _whole()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


EMBEDDED_START_S = "120"


def main() -> None:
    # Prefect gives its embedded server 20 s to start. Under load (two cores running flows, a
    # benchmark, a build) it has been seen to need more, and a service that cannot reach its API
    # acts on no fault; set the variable to choose another bound.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", EMBEDDED_START_S)
    first = sys.argv[1] if len(sys.argv) > 1 else None
    try:
        build([first] if first in COMMANDS else COMMANDS)()
    except PolicyError as error:  # a broken config file: file:line:column, no traceback
        err.print(str(error), markup=False, highlight=False)
        raise SystemExit(2) from None
    except BackendError as error:  # `medic serve` (or a flow) with a backend unconfigured or wrong
        err.print(f"error: {error}", markup=False, highlight=False)
        raise SystemExit(2) from None
    except ModuleNotFoundError as error:
        # A node bundle (`gpu-medic[node]`, no Prefect) asked for a control-plane command: whichever of the
        # `server` extra's packages it reached first is missing; say what to install. Anything else is a bug.
        ours = (error.name or "medic").split(".")[0] == "medic"
        if ours or importlib.util.find_spec("prefect") is not None:
            raise
        command = f"medic {first}" if first in COMMANDS else "this command"
        err.print(
            f"error: {command} needs GPU Medic's control plane ({error.name} is not installed): "
            "pip install 'gpu-medic[server]'",
            markup=False,
            highlight=False,
        )
        raise SystemExit(2) from None
