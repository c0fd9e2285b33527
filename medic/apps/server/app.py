"""The ingest app: POST /v1/events, /v1/sentry, /v1/alertmanager; GET /healthz, /metrics (docs/serve.md).

An event is committed to the store before its request is answered; only then is it handed
to `on_accepted`, one batch at a time and in order, by a task that outlives the request.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel

from medic.alerts import AlertMap, shipped_map
from medic.apps.server import alertmanager, sentry
from medic.apps.server.auth import SIGNATURE_HEADER, Auth
from medic.apps.server.cloudevents import binary_headers
from medic.apps.server.decode import Decoded, Problem, decode
from medic.apps.server.group_commit import GroupCommit
from medic.apps.server.metrics import IngestMetrics
from medic.apps.server.slack import SlackCallbacks, refuse_early
from medic.apps.server.slack import handle as handle_slack
from medic.events import FaultEvent
from medic.store import Store
from medic.store.engine import unavailable

log = logging.getLogger("medic.apps.server")

MAX_BODY_BYTES = 16 * 1024 * 1024
SLACK_MAX_BODY_BYTES = 1024 * 1024  # an interaction payload is a few KB
# At shutdown, queued batches are handed on for at most this long; the rest stay stored and
# undispatched, and the next start hands them on (its backlog).
HAND_ON_GRACE_S = 3.0
# How long a sender is asked to wait before it sends again what a store that did not answer refused.
STORE_DOWN_RETRY_S = 5
OnAccepted = Callable[[list[FaultEvent]], Awaitable[None]]
OnStart = Callable[[], Awaitable[None]]


class IngestReply(BaseModel):
    """Every posted item is counted in `accepted`, listed in `duplicates` or described in `rejected`.

    A flood of bad items is described by a sample: `rejected` holds the first `DEAD_LETTER_SAMPLE`,
    and then `rejected_total` says how many there were and `dead_lettered` how many of them the
    dead letter kept verbatim (both only then, so a normal answer is as it always was).
    """

    accepted: int
    duplicates: list[str]
    rejected: list[Problem]
    rejected_total: int | None = None
    dead_lettered: int | None = None


class _Refused(Exception):
    def __init__(self, status: int, error: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(error)
        self.response = JSONResponse({"error": error}, status_code=status, headers=headers)


@dataclass(frozen=True, slots=True)
class Ingested:
    reply: IngestReply
    stored: list[FaultEvent]  # new events, committed
    received: int  # items in the body, valid or not
    rejected: int  # items in the body that were not events, listed in the reply or not


@dataclass(frozen=True, slots=True)
class _Writer:
    """How a request writes: its events with the others' waiting (GroupCommit), and `writes` taken
    around every write (on SQLite, one writer at a time)."""

    store: Store
    writes: AbstractContextManager[Any]
    events: GroupCommit

    @classmethod
    def of(cls, store: Store) -> _Writer:
        # SQLite has one writer at a time and its busy handler sleeps in growing steps: queueing
        # on a lock here instead keeps throughput up and latency flat under many connections.
        writes = threading.Lock() if store.engine.dialect.name == "sqlite" else nullcontext()

        def record(events: list[FaultEvent]) -> list[FaultEvent]:
            with writes:
                return store.record_accepted(events)

        return cls(store, writes, GroupCommit(record))


def ingest(
    writer: _Writer,
    body: bytes,
    content_type: str | None,
    remote: str,
    ce_headers: dict[str, str] | None = None,
) -> Ingested:
    """Validate one body and commit what it holds (blocking: run it in a worker thread)."""
    return commit(writer, decode(body, content_type, remote, ce_headers))


def commit(writer: _Writer, decoded: Decoded) -> Ingested:
    """Store the events and the rejections of a decoded body; describe the outcome."""
    stored = writer.events.record(decoded.events) if decoded.events else []
    with writer.writes:
        dead = writer.store.dead_letter(decoded.rejections)
    unclaimed, duplicates = {e.id for e in stored}, []
    for event in decoded.events:
        if event.id in unclaimed:
            unclaimed.discard(event.id)  # its first copy was stored; any later one is a duplicate
        else:
            duplicates.append(event.id)
    reply = IngestReply(accepted=len(stored), duplicates=duplicates, rejected=decoded.problems)
    if dead.rejected != len(decoded.problems) or dead.kept != dead.rejected:
        reply.rejected_total, reply.dead_lettered = dead.rejected, dead.kept
    return Ingested(reply, stored, len(decoded.events) + dead.rejected, dead.rejected)


def _store_down(path: str, error: Exception) -> Response:
    """Nothing was stored, so nothing is acknowledged: a 503 asks the sender to send it again (Alertmanager
    and most webhook senders retry a 5xx and drop a 4xx), after `STORE_DOWN_RETRY_S`. The reason names
    the error's type only: where the database is stays in the log."""
    log.warning("%s: the store does not answer, answered 503: %s", path, error)
    return JSONResponse(
        {"error": f"the store does not answer ({type(error).__name__}); nothing was stored: send it again"},
        status_code=503,
        headers={"Retry-After": str(STORE_DOWN_RETRY_S)},
    )


def create_app(
    store: Store,
    *,
    tokens: set[str],
    hmac_secret: bytes | None,
    on_accepted: OnAccepted | None,
    max_body_bytes: int = MAX_BODY_BYTES,
    slack: SlackCallbacks | None = None,
    sentry_secret: bytes | None = None,
    sentry_options: sentry.Options | None = None,
    on_start: OnStart | None = None,
    alert_map: AlertMap | None = None,
) -> FastAPI:
    """The app. `on_start` runs once at startup, beside the backlog's hand-on (the warm path
    resumes there the incidents a previous process left unfinished)."""
    relay = _Relay(on_accepted) if on_accepted is not None else None
    app = FastAPI(
        title="GPU Medic ingest",
        lifespan=_lifespan(store, relay, on_start),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    routes = _IngestRoutes(
        Auth.of(tokens, hmac_secret), IngestMetrics(store), relay, _Writer.of(store), max_body_bytes
    )
    routes.add(app, "/v1/events", routes.post_events)
    mapping = alert_map if alert_map is not None else shipped_map()
    routes.add(app, "/v1/alertmanager", lambda request: routes.post_alertmanager(request, mapping))
    if sentry_secret:
        options = sentry_options or sentry.Options()
        routes.add(app, "/v1/sentry", lambda request: routes.post_sentry(request, sentry_secret, options))
    if slack is not None:
        _add_slack(app, slack)
    _add_health(app, store, routes.metrics)
    return app


def _lifespan(
    store: Store, relay: _Relay | None, on_start: OnStart | None
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Startup hands on the backlog and runs `on_start`; shutdown hands on what is queued, briefly."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if relay is None:
            yield
            return
        # Events accepted before a crash but never handed on go first.
        backlog = await anyio.to_thread.run_sync(store.undispatched_events)
        if on_start is not None:
            await on_start()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(relay.run, backlog)
            try:
                yield
            finally:
                relay.close()  # it hands on what is queued, then ends; shutdown waits for it, briefly
                with anyio.move_on_after(HAND_ON_GRACE_S):
                    await relay.finished.wait()
                tasks.cancel_scope.cancel()

    return lifespan


@dataclass(frozen=True, slots=True)
class _IngestRoutes:
    """The POST routes that store events: each authenticates, reads a bounded body, commits in a
    worker thread and answers with what was stored, counted on /metrics."""

    auth: Auth
    metrics: IngestMetrics
    relay: _Relay | None
    writer: _Writer
    max_body_bytes: int

    def add(self, app: FastAPI, path: str, handler: Callable[[Request], Awaitable[Response]]) -> None:
        """Add an ingest route: a refusal is its answer, and every answer is timed by its status."""

        async def route(request: Request) -> Response:
            started, code = time.perf_counter(), 500  # 500 unless answered: a bug of ours
            try:
                try:
                    response = await handler(request)
                except _Refused as refused:
                    response = refused.response
                except Exception as error:
                    if not unavailable(error):
                        raise
                    response = _store_down(path, error)
                code = response.status_code
                return response
            finally:
                self.metrics.latency.labels(code=str(code)).observe(time.perf_counter() - started)

        app.add_api_route(path, route, methods=["POST"])

    def answered(self, done: Ingested, ignored: list[alertmanager.Ignored] | None = None) -> Response:
        self.metrics.received.inc(done.received)
        self.metrics.stored.inc(len(done.stored))
        self.metrics.duplicates.inc(len(done.reply.duplicates))
        self.metrics.rejected.inc(done.rejected)
        if done.stored and self.relay is not None:
            self.relay.send(done.stored)
        reply = done.reply.model_dump(exclude_none=True)
        if ignored:
            reply["ignored"] = [i.model_dump() for i in ignored]
        # 202: an authentic body that held nothing to act on (as /v1/sentry answers it).
        status = 422 if done.rejected else 202 if ignored and not done.received else 200
        return JSONResponse(reply, status_code=status)

    async def post_events(self, request: Request) -> Response:
        if self.auth.bearer_ok(request.headers.get("authorization")):
            body = await _read_body(request, self.max_body_bytes)
        elif request.headers.get(SIGNATURE_HEADER) and self.auth.hmac_secret is not None:
            body = await _read_body(request, self.max_body_bytes)
            if not self.auth.signature_ok(request.headers.get(SIGNATURE_HEADER), body):
                raise _Refused(401, f"{SIGNATURE_HEADER} does not match the body")
        else:
            raise _Refused(
                401, f"a bearer token or an {SIGNATURE_HEADER} is required", {"WWW-Authenticate": "Bearer"}
            )
        _refuse_encoded(request)
        content_type = request.headers.get("content-type")
        ce_headers = binary_headers(request.headers.items())  # CloudEvents binary mode
        done = await anyio.to_thread.run_sync(
            ingest, self.writer, body, content_type, _remote(request), ce_headers
        )
        return self.answered(done)

    async def post_alertmanager(self, request: Request, mapping: AlertMap) -> Response:
        authorization = request.headers.get("authorization")
        if not (self.auth.bearer_ok(authorization) or self.auth.basic_ok(authorization)):
            raise _Refused(
                401,
                "a bearer token, or basic auth with a token as password, is required",
                {"WWW-Authenticate": alertmanager.CHALLENGE},
            )
        body = await _read_body(request, self.max_body_bytes)
        _refuse_encoded(request)

        def take(remote: str) -> tuple[Ingested, list[alertmanager.Ignored]]:
            translated = alertmanager.translate(body, remote, mapping)
            return commit(self.writer, translated.decoded), translated.ignored

        done, ignored = await anyio.to_thread.run_sync(take, _remote(request))
        for _ in ignored:
            self.metrics.alertmanager_ignored.labels(reason=alertmanager.RESOLVED).inc()
        return self.answered(done, ignored)

    async def post_sentry(self, request: Request, secret: bytes, options: sentry.Options) -> Response:
        body = await _read_body(request, self.max_body_bytes)
        if not sentry.signature_ok(secret, body, request.headers.get(sentry.SIGNATURE_HEADER)):
            raise _Refused(401, f"{sentry.SIGNATURE_HEADER} does not match the body")
        # Checked after the signature, so a stranger learns nothing; the timestamp itself is
        # not signed, so this bounds replays of a captured request, and event ids dedupe the rest.
        stale = sentry.timestamp_problem(
            request.headers.get(sentry.TIMESTAMP_HEADER), time.time(), options.window_s
        )
        if stale:
            raise _Refused(401, stale)
        _refuse_encoded(request)
        resource = request.headers.get(sentry.RESOURCE_HEADER)

        def take(remote: str) -> Ingested | sentry.Translated:
            """Translate and commit in one trip to a worker thread: the loop only reads and answers."""
            translated = sentry.translate(body, resource, remote, reject_unmatched=options.reject_unmatched)
            return translated if translated.ignored else commit(self.writer, translated.decoded)

        done = await anyio.to_thread.run_sync(take, _remote(request))
        if isinstance(done, sentry.Translated):
            self.metrics.sentry_ignored.labels(reason=done.reason or sentry.NO_ERROR_EVENT).inc()
            return JSONResponse({"ignored": done.ignored}, status_code=202)
        return self.answered(done)


def _add_slack(app: FastAPI, slack: SlackCallbacks) -> None:
    @app.post("/v1/slack/interactions")
    async def slack_interactions(request: Request) -> Response:
        # Refused before a byte of the body is read when it is unsigned or stale, and read
        # only up to Slack's size: an unauthenticated flood never grows the service.
        early = refuse_early(request)
        if early is not None:
            return early
        try:
            body = await _read_body(request, SLACK_MAX_BODY_BYTES)
        except _Refused as refused:
            return refused.response
        return await handle_slack(request, body, slack)


def _add_health(app: FastAPI, store: Store, metrics: IngestMetrics) -> None:
    @app.get("/healthz")
    async def healthz() -> Response:
        try:
            await anyio.to_thread.run_sync(store.ping)
        except Exception as error:  # any failure to reach the database is "unavailable"
            # The reason names the database's host, name or path: for the log, not for anyone
            # who can reach this unauthenticated route.
            log.warning("healthz: the store does not answer: %s", error)
            return JSONResponse(
                {"status": "unavailable", "error": f"the store does not answer ({type(error).__name__})"},
                status_code=503,
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        # Prometheus text format, or OpenMetrics when the scraper asks for it.
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        text = await anyio.to_thread.run_sync(encode, metrics.registry)
        return Response(text, headers={"Content-Type": content_type})


RELAY_BATCH = 1000  # events handed on in one call at most, as many requests' batches as are waiting
HAND_ON_RETRY_S = (0.5, 2.0, 8.0)  # the waits before each new try of a batch whose hand-on failed


class _Relay:
    """Hands committed batches to `on_accepted` one at a time, in order, outside any request."""

    def __init__(self, on_accepted: OnAccepted) -> None:
        self.on_accepted = on_accepted
        self._out, self._in = anyio.create_memory_object_stream[list[FaultEvent]](math.inf)
        self.finished = anyio.Event()

    def send(self, events: list[FaultEvent]) -> None:
        self._out.send_nowait(events)

    def close(self) -> None:
        self._out.close()

    async def run(self, backlog: list[FaultEvent]) -> None:
        try:
            if backlog:
                await self._hand_on(backlog)
            async with self._in:
                async for events in self._in:
                    # What queued while the last batch was handed on goes on together: one call
                    # for many one-event requests, in their order.
                    while len(events) < RELAY_BATCH:
                        try:
                            events = events + self._in.receive_nowait()
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    await self._hand_on(events)
        finally:
            self.finished.set()

    async def _hand_on(self, events: list[FaultEvent]) -> None:
        """Hand a batch on; one that fails is tried again after each of `HAND_ON_RETRY_S` (the next
        batches wait: they go on in order). The hook is idempotent, so a retry of what half
        succeeded only finishes it. One that still fails stays stored, for the next start's backlog,
        and the next batch goes on: one batch the hook cannot take must not stop the rest."""
        for wait_s in (*HAND_ON_RETRY_S, None):
            try:
                await self.on_accepted(events)
                return
            except Exception:
                if wait_s is None:
                    log.exception(
                        "on_accepted failed for %d events, %d times; they stay stored and the next "
                        "start hands them on",
                        len(events),
                        len(HAND_ON_RETRY_S) + 1,
                    )
                    return
                # A store or Prefect API that failed one call under load (a pool that timed out, a
                # connection reset) mostly answers the next: without a retry the batch waited for a
                # restart that may never come.
                log.warning(
                    "on_accepted failed for %d events; again in %g s", len(events), wait_s, exc_info=True
                )
                await anyio.sleep(wait_s)


def _refuse_encoded(request: Request) -> None:
    """A compressed body would be read as text and dead-lettered as junk: 415, and nothing stored.
    Not decompressed either: 16 MiB of gzip can stand for gigabytes."""
    codings = [c.strip() for c in request.headers.get("content-encoding", "").split(",") if c.strip()]
    if any(c.lower() != "identity" for c in codings):
        raise _Refused(
            415,
            f"Content-Encoding {', '.join(codings)[:100]} is not supported: send the body uncompressed",
            {"Accept-Encoding": "identity"},
        )


def _remote(request: Request) -> str:
    return request.client.host if request.client else "unknown"


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    # ASCII digits only: `isdigit` holds for "²" too, which int() refuses.
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise _Refused(413, f"body larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _Refused(413, f"body larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
