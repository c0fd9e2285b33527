"""The `medic` command line (docs/cli.md): the root app; each command family has its own module."""

from __future__ import annotations

import os

import typer

from apps.cli._common import err
from apps.cli.advise import advise_app
from apps.cli.agent import agent
from apps.cli.audit import audit_app
from apps.cli.breaker import breaker_app
from apps.cli.check import check_app
from apps.cli.dcgm import dcgm_app
from apps.cli.demo import demo
from apps.cli.doctor import doctor
from apps.cli.fleet import fleet_app
from apps.cli.goodput import goodput
from apps.cli.incidents import incident, incidents
from apps.cli.policy import policy_app
from apps.cli.report import report
from apps.cli.serve import emit, serve
from apps.cli.simulate import simulate
from apps.cli.sweep import sweep_app
from apps.cli.triage import ingest, schema, triage
from integrations.registry import BackendError
from medic.policy import PolicyError

app = typer.Typer(
    name="medic",
    help="GPU Medic: automated fault remediation for GPU training clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# `medic --help` lists the commands in registration order: keep it.
for command in (
    serve,
    agent,
    emit,
    triage,
    ingest,
    incidents,
    incident,
    demo,
    doctor,
    goodput,
    report,
    simulate,
    schema,
):
    app.command()(command)
app.add_typer(policy_app, name="policy")
app.add_typer(dcgm_app, name="dcgm")
app.add_typer(advise_app, name="advise")
app.add_typer(breaker_app, name="breaker")
app.add_typer(audit_app, name="audit")
app.add_typer(check_app, name="check")
app.add_typer(fleet_app, name="fleet")
app.add_typer(sweep_app, name="sweep")


EMBEDDED_START_S = "120"


def main() -> None:
    # Prefect gives its embedded server 20 s to start. Under load (two cores running flows, a
    # benchmark, a build) it has been seen to need more, and a service that cannot reach its API
    # acts on no fault; set the variable to choose another bound.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", EMBEDDED_START_S)
    try:
        app()
    except PolicyError as error:  # a broken config file: file:line:column, no traceback
        err.print(str(error), markup=False, highlight=False)
        raise SystemExit(2) from None
    except BackendError as error:  # `medic serve` (or a flow) with a backend unconfigured or wrong
        err.print(f"error: {error}", markup=False, highlight=False)
        raise SystemExit(2) from None
