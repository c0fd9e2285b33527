"""Where a node-side reporter (the agent, the Slurm hooks) sends its FaultEvents.

- a JSON-lines file (one O_APPEND write per batch, so several writers can share it),
- standard output (`-`),
- GPU Medic's ingest service: POST {MEDIC_URL}/v1/events, JSON lines, `Authorization: Bearer
  $MEDIC_TOKEN`. Deliveries that fail for a passing reason (no connection, 5xx, 429) are kept
  and sent first next time, so a restart of the service loses nothing a node saw.
"""

from __future__ import annotations

import logging
import os
import sys
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from medic.events import FaultEvent

log = logging.getLogger(__name__)

URL_ENV = "MEDIC_URL"
TOKEN_ENV = "MEDIC_TOKEN"
EVENTS_PATH = "/v1/events"
CONTENT_TYPE = "application/x-ndjson"
MAX_PENDING = 1000  # events kept for a later try while the service is unreachable
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class EventSink(Protocol):
    def emit(self, events: Sequence[FaultEvent]) -> None: ...


def _lines(events: Sequence[FaultEvent]) -> bytes:
    return "".join(event.model_dump_json(exclude_none=True) + "\n" for event in events).encode()


class FileSink:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def emit(self, events: Sequence[FaultEvent]) -> None:
        if not events:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, _lines(events))
        finally:
            os.close(fd)


class StdoutSink:
    def emit(self, events: Sequence[FaultEvent]) -> None:
        if events:
            sys.stdout.write(_lines(events).decode())
            sys.stdout.flush()


class HttpSink:
    def __init__(
        self, base_url: str, token: str, timeout_s: float = 5.0, max_pending: int = MAX_PENDING
    ) -> None:
        self.url = base_url.rstrip("/") + EVENTS_PATH
        self.token = token
        self.timeout_s = timeout_s
        self.pending: deque[FaultEvent] = deque(maxlen=max_pending)

    def request(self, events: Sequence[FaultEvent]) -> urllib.request.Request:
        return urllib.request.Request(
            self.url,
            data=_lines(events),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": CONTENT_TYPE},
            method="POST",
        )

    def emit(self, events: Sequence[FaultEvent]) -> None:
        dropped = max(0, len(self.pending) + len(events) - (self.pending.maxlen or 0))
        if dropped:
            log.error("%d undelivered events dropped: the service was unreachable too long", dropped)
        self.pending.extend(events)
        if not self.pending:
            return
        batch = list(self.pending)
        try:
            with urllib.request.urlopen(self.request(batch), timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as error:
            detail = error.read(500).decode(errors="replace")
            if error.code in RETRY_STATUSES:
                log.warning(
                    "%s answered %d; %d events kept for the next try", self.url, error.code, len(batch)
                )
                return
            # The service refused them (bad token, invalid events): sending again cannot help.
            log.error("%s refused %d events (HTTP %d): %s", self.url, len(batch), error.code, detail)
        except (urllib.error.URLError, OSError) as error:
            log.warning(
                "could not reach %s (%s); %d events kept for the next try", self.url, error, len(batch)
            )
            return
        self.pending.clear()


def sink_from(target: str | None, env: Mapping[str, str]) -> EventSink:
    """`-` for standard output, an http(s) URL (the service's base URL), or a file path.
    None: $MEDIC_URL when set, else standard output. HTTP needs $MEDIC_TOKEN."""
    target = target or env.get(URL_ENV) or "-"
    if target == "-":
        return StdoutSink()
    if target.startswith(("http://", "https://")):
        token = env.get(TOKEN_ENV)
        if not token:
            raise ValueError(f"sending events to {target} needs a bearer token in ${TOKEN_ENV}")
        return HttpSink(target, token)
    return FileSink(target)
