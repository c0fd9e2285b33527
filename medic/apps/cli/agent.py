"""`medic agent`: the node agent (docs/agent.md). Also runs alone as `python -m medic.apps.cli.agent`,
which skips the rest of the CLI's imports: less memory for a process that lives on every node."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from medic.apps.agent import DEFAULT_INTERVAL_S, DEFAULT_MAX_BACKOFF_S, Agent, AgentOptions
from medic.integrations.kernel_log import KernelLog
from medic.integrations.nvml import NvmlSession
from medic.integrations.sinks import sink_from

DEFAULT_KMSG = Path("/dev/kmsg")


def agent(
    interval: Annotated[
        float, typer.Option(min=0.05, help="Seconds between polls.", show_default=True)
    ] = DEFAULT_INTERVAL_S,
    kmsg: Annotated[
        Path, typer.Option(help="Kernel log to read XIDs from: /dev/kmsg, or a file something appends to.")
    ] = DEFAULT_KMSG,
    no_kmsg: Annotated[bool, typer.Option("--no-kmsg", help="Read no kernel log (NVML only).")] = False,
    no_nvml: Annotated[bool, typer.Option("--no-nvml", help="Do not use NVML (kernel log only).")] = False,
    sink: Annotated[
        str | None,
        typer.Option(
            help="Where events go: a file (JSON lines), '-' for standard output, or GPU Medic's URL "
            "(bearer token from $MEDIC_TOKEN). Default: $MEDIC_URL, else standard output."
        ),
    ] = None,
    node: Annotated[
        str | None, typer.Option(help="Node name in events (default: this host's short name).")
    ] = None,
    switch: Annotated[str | None, typer.Option(help="Leaf switch or rack, for correlation.")] = None,
    expected_gpus: Annotated[
        int | None,
        typer.Option(min=0, help="GPUs this node should have (default: what the first NVML read finds)."),
    ] = None,
    max_backoff: Annotated[
        float, typer.Option(min=0.05, help="Longest wait before trying a failing NVML again (s).")
    ] = DEFAULT_MAX_BACKOFF_S,
    once: Annotated[bool, typer.Option("--once", help="Poll once and exit.")] = False,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Watch this node's GPUs (NVML) and kernel log; report each new fault once."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        events_sink = sink_from(sink, os.environ)
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    options = AgentOptions(
        node=node or socket.gethostname().split(".")[0],
        switch=switch,
        interval_s=interval,
        expected_gpus=expected_gpus,
        max_backoff_s=max_backoff,
    )
    watcher = Agent(
        options,
        events_sink,
        nvml=None if no_nvml else NvmlSession(),
        kernel_log=None if no_kmsg else KernelLog(kmsg),
    )
    if once:
        watcher.poll()
        if watcher.nvml:
            watcher.nvml.close()
        return
    stop = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        logging.getLogger(__name__).info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    watcher.run(stop)


if __name__ == "__main__":
    typer.run(agent)
