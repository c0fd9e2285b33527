"""`medic serve` and `medic emit`: the HTTP ingest service and its client (docs/serve.md).

Plain functions with typer options, registered in medic/apps/cli/app.py.
"""

from __future__ import annotations

import json
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import httpx
import typer
from rich.markup import escape

from medic.apps.cli._common import err
from medic.apps.server import DEFAULT_HOST, DEFAULT_PORT, embedded
from medic.apps.server.emit import DEFAULT_URL, TOKEN_ENV, URL_ENV, build_event, parse_attribute, post_events

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from medic.apps.server.people import PeopleWatch
    from medic.apps.server.slack import SlackCallbacks
    from medic.flows.live import LiveDispatcher
    from medic.tasks.runtime.process import Runtime


class Dispatch(StrEnum):
    LOCAL = "local"
    PREFECT = "prefect"


def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = DEFAULT_PORT,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = True,
    dispatch: Annotated[
        Dispatch,
        typer.Option(
            envvar="MEDIC_DISPATCH",
            help="local: remediate in this process (warm path); prefect: announce incidents for the "
            "deployment's trigger to run on workers.",
        ),
    ] = Dispatch.LOCAL,
) -> None:
    """Run the HTTP ingest service: POST /v1/events, GET /healthz, GET /metrics."""
    from medic.apps.server.main import ServeConfigError
    from medic.apps.server.main import serve as run_server
    from medic.tasks.notify import left_behind

    if dispatch is Dispatch.PREFECT and not _prefect_api_url():
        # An embedded Prefect server has no workers: every incident would wait forever.
        err.print("[red]error:[/red] --dispatch prefect needs PREFECT_API_URL: the server the workers poll")
        raise typer.Exit(2)
    embedded.claim()  # before the warm-up starts this service's own embedded server
    dispatcher, slack = _remediation(dispatch, port)
    try:
        people = people_watch(dispatcher.rt)
    except ValueError as error:
        err.print(f"[red]error:[/red] {escape(str(error))}")
        raise typer.Exit(2) from None
    policy = dispatcher.rt.policy_status()
    if policy.sha256 is None:
        # No policy has ever loaded: every accepted event would wait for an incident that cannot be
        # decided. Refuse to start rather than acknowledge faults we cannot handle.
        err.print(f"[red]error:[/red] {escape(policy.problem or 'no policy loads')}")
        raise typer.Exit(2)
    try:
        run_server(
            host,
            port,
            on_accepted=dispatcher,
            slack=slack,
            log_level=log_level,
            access_log=access_log,
            on_start=_background(dispatcher if dispatch is Dispatch.LOCAL else None, people),
            on_stop=left_behind,  # says how many chat messages stay in the outbox for the next start
        )
    except ServeConfigError as error:
        err.print(f"[red]error:[/red] {escape(str(error))}")
        raise typer.Exit(2) from None
    finally:
        dispatcher.close()


def _remediation(dispatch: Dispatch, port: int) -> tuple[LiveDispatcher, SlackCallbacks]:
    """The dispatcher (the warm path, or the trigger's) and Slack's approval callbacks.

    Imported here, not at the top: `medic triage` and `medic emit` must not load Prefect.
    """
    from prefect.flow_runs import resume_flow_run

    from medic.apps.server.slack import SlackCallbacks
    from medic.flows.deployed import DeployedDispatcher
    from medic.flows.leases import Leases, runner_name
    from medic.flows.live import LiveDispatcher
    from medic.tasks.runtime.process import current

    rt = current()
    leases = Leases(rt.store, runner_name(f"serve-{port}"))
    kind = LiveDispatcher if dispatch is Dispatch.LOCAL else DeployedDispatcher
    dispatcher = kind(rt, leases)
    dispatcher.warm_up_in_background()  # Prefect's API starts now, not when the first fault arrives
    slack = SlackCallbacks(
        approvers=lambda: rt.approvers().ids,
        # Called in a worker thread (medic/apps/server/slack.py), where Prefect's async_dispatch runs the sync
        # version, which returns None; its typing says it may return a coroutine.
        resume=resume_flow_run,  # type: ignore[arg-type]
        claim=lambda incident, approved, by: rt.store.claim_answer(
            incident, approved=approved, by=by, via="slack"
        ),
        reopen=rt.store.reopen_approval,
    )
    return dispatcher, slack


def people_watch(rt: Runtime) -> tuple[PeopleWatch, float] | None:
    """The watch of what people do to nodes in Slurm, and its interval: only beside a Slurm scheduler,
    and not with MEDIC_SLURM_WATCH_SECONDS=0 (docs/decisions/0019)."""
    from medic.apps.server.people import PeopleWatch, interval_s, ours_in
    from medic.integrations.slurm import SlurmCli, SlurmScheduler
    from medic.integrations.slurm.watch import NodeWatch

    every_s = interval_s(os.environ)
    scheduler = rt.backends.scheduler
    if not every_s or not isinstance(scheduler, SlurmScheduler):
        return None
    # Its own client: one listing per interval, and a slurmctld that does not answer within it is a
    # failed poll, not a pile of waiting ones.
    cli = SlurmCli(scheduler.cli.slurm_conf, timeout_s=min(every_s, scheduler.cli.timeout_s))
    return PeopleWatch(rt.store, NodeWatch(cli, ours_in(rt.store))), every_s


def _background(
    dispatcher: LiveDispatcher | None, people: tuple[PeopleWatch, float] | None
) -> Callable[[], Awaitable[None]]:
    """The service's periodic work, from startup on. With the warm path, every third of a lease, a flow
    run for every incident still being handled that no live run holds: left so by this service's
    predecessor (stopped or killed mid-run) or by a replica that died. Node actions already taken are
    not repeated (they are claimed once per fault), and actions a crash left without an outcome are
    settled first. Beside Slurm, the poll of what people do to nodes."""
    import asyncio

    running: set[asyncio.Task[None]] = set()

    async def start() -> None:
        loops = []
        if dispatcher is not None:
            loops.append(dispatcher.pickup_forever(dispatcher.leases.lease_s / 3))
        if people is not None:
            loops.append(people[0].forever(people[1]))
        for loop in loops:
            running.add(asyncio.create_task(loop))  # held: the loop keeps only weak references to tasks

    return start


def _prefect_api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def emit(
    kind: Annotated[str | None, typer.Option(help="Event kind: xid, ecc, nan_loss, ...")] = None,
    node: Annotated[str | None, typer.Option(help="The node the event is about.")] = None,
    gpu: Annotated[int | None, typer.Option(help="GPU index on the node.")] = None,
    job: Annotated[str | None, typer.Option(help="Training job id.")] = None,
    rank: Annotated[int | None, typer.Option(help="Rank in the job.")] = None,
    iteration: Annotated[int | None, typer.Option(help="Training iteration.")] = None,
    switch: Annotated[str | None, typer.Option(help="Leaf switch or rack.")] = None,
    attr: Annotated[
        list[str] | None,
        typer.Option("--attr", help="An attribute as key=value (value read as JSON); repeat."),
    ] = None,
    source: Annotated[str, typer.Option(help="Who saw it.")] = "medic-emit",
    event_id: Annotated[str | None, typer.Option("--id", help="Event id (default: a new UUID).")] = None,
    time: Annotated[str | None, typer.Option(help="RFC 3339 time (default: now).")] = None,
    file: Annotated[
        Path | None, typer.Option("--file", "-f", help="Post this JSON-lines file instead ('-': stdin).")
    ] = None,
    url: Annotated[str, typer.Option(envvar=URL_ENV, help="The medic serve address.")] = DEFAULT_URL,
) -> None:
    """Post one event built from options, or a JSON-lines file, to `medic serve`; print its answer."""
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise typer.BadParameter(f"set {TOKEN_ENV} to an ingest token", param_hint=TOKEN_ENV)
    if file is not None:
        if kind or node:
            raise typer.BadParameter("give either --file or --kind/--node, not both")
        body = sys.stdin.buffer.read() if str(file) == "-" else _read(file)
        content_type = "application/x-ndjson"
    else:
        if not kind or not node:
            raise typer.BadParameter("--kind and --node are required without --file")
        try:
            attributes = dict(parse_attribute(pair) for pair in attr or [])
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--attr") from None
        event = build_event(
            kind=kind,
            node=node,
            source=source,
            event_id=event_id,
            time=time,
            attributes=attributes,
            gpu=gpu,
            job=job,
            rank=rank,
            iteration=iteration,
            switch=switch,
        )
        body, content_type = json.dumps(event).encode(), "application/json"
    try:
        response = post_events(url, token, body, content_type)
    except httpx.HTTPError as error:
        err.print(f"[red]error:[/red] {escape(url)}: {escape(str(error) or type(error).__name__)}")
        raise typer.Exit(1) from None
    sys.stdout.write(response.text.rstrip("\n") + "\n")
    if not response.is_success:
        raise typer.Exit(1)


def _read(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as error:
        raise typer.BadParameter(f"{file}: {error.strerror or error}", param_hint="--file") from None
