"""Holding guardrails across concurrent flow runs.

Each flow run decides with the fleet as it saw it a moment ago; two runs could both see room
for one more node out of service and both take one. So the last check and the action happen
under one Prefect global concurrency slot (strict: a missing limit is an error, never a silent
"unlimited"), with the fleet state read again inside it.

Every transition that takes a node out of service goes through the slot: destructive actions
(`medic/tasks/act.py`) check under `guarded` and drain inside it; every plain drain (a `drain` action,
the drain before a DCGM level 2-4 run, the drain while an approval is awaited) goes through
`take_out_of_service` in `medic/tasks/nodes/service.py`, and `ensure_drained` refuses to run outside a
`guarded` block. The slot is held once per transition: a `guarded` inside another (same thread
or task) checks again without taking the slot a second time.

The slot is taken with Prefect's lease API directly rather than `prefect.concurrency`: on the
embedded (SQLite) server an acquisition that meets a concurrent write is answered 503, and
Prefect's client waits a fixed 2 s before trying again. That wait sat between a fault and its
drain; here a busy answer is retried after milliseconds. The lease is short and renewed while
held, so a holder that dies (a replica killed mid-action) frees the slot within about 75 s.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from uuid import UUID

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.exceptions import ObjectAlreadyExists
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from medic.errors import MedicError, PermanentError, TransientError
from medic.policy import Decision
from medic.store import utcnow
from medic.tasks.nodes.evidence import check_rails, record_breaker_trip
from medic.tasks.runtime.process import Runtime

log = logging.getLogger("medic.guard")

NODE_ACTIONS_LIMIT = "medic-node-actions"
# Prefect's shortest lease, renewed every third of it while held (a drain, a job moved off and a
# provider call can take minutes), so a holder killed mid-action blocks every other run's node
# actions only until the lease lapses and Prefect's repossessor (every 15 s) takes the slot back.
LEASE_SECONDS = 60.0
WAIT_SECONDS = 600.0
# Prefect's Retry-After spreads a busy limit's waiters over up to 30 s (its average occupancy): a
# containment step would sit out half a minute after the slot freed. One slot and a handful of
# waiting runs: asking every 2 s at most is cheap.
MAX_PAUSE_S = 2.0
INCREMENT_PATH = "/v2/concurrency_limits/increment-with-lease"
BUSY = (423, 503)  # 423: another run holds the slot; 503: the server's database was busy
_ensured: set[str] = set()
# True while this context is inside a `guarded` block (holding the slot when run in a flow).
_inside: ContextVar[bool] = ContextVar("medic_inside_guarded", default=False)


async def ensure_limits() -> None:
    """Create the limit once per process and API.

    Prefect's upsert reads, then creates: replicas starting together on a fresh API both find no
    limit, and the one that creates it second is refused (409). It then reads the one made, as its
    first containment would otherwise fail. Known by the configured URL (none: the process's
    embedded server), so that a containment or a flow run that finds it made does not build a
    client to learn so."""
    key = str(PREFECT_API_URL.value())
    if key in _ensured:
        return
    async with get_client() as client:
        try:
            await client.upsert_global_concurrency_limit_by_name(NODE_ACTIONS_LIMIT, 1)
        except ObjectAlreadyExists:
            await client.upsert_global_concurrency_limit_by_name(NODE_ACTIONS_LIMIT, 1)
    _ensured.add(key)


@contextmanager
def guarded(
    rt: Runtime, node: str, decision: Decision, holder: UUID | None = None
) -> Iterator[tuple[str, str] | None]:
    """Yield the guardrail the action would now break (None: go ahead) while holding the slot.

    The slot is held as this flow run, or as `holder` outside one (a containment, which comes
    before its flow run). Re-entrant: inside another `guarded` block the slot is already held,
    so only the check runs."""

    def recheck() -> tuple[str, str] | None:
        policy = rt.policy().policy
        state, stopped = check_rails(rt, policy, utcnow(), rt.backends.scheduler.nodes(), node, decision)
        record_breaker_trip(rt, state, stopped, decision.incident)
        return stopped

    if _inside.get():  # the slot is ours already: taking it again would wait on ourselves
        yield recheck()
        return
    token = _inside.set(True)
    try:
        if flow_run.id is not None:
            holder = UUID(flow_run.id)
        if holder is None:  # called directly (tests, benchmarks): one process, nothing to race
            yield recheck()
            return
        with node_actions_slot(holder):
            yield recheck()
    finally:
        _inside.reset(token)


def inside_guarded() -> bool:
    """Whether this context is inside a `guarded` block: the only place a node may be taken out."""
    return _inside.get()


class SlotUnavailable(MedicError, RuntimeError):
    """Raised when the `medic-node-actions` slot cannot be had; the subclasses say why."""


class SlotBusy(SlotUnavailable, TransientError):
    """Raised when other runs held the slot for the whole wait: the action was not attempted."""


class SlotLimitMissing(SlotUnavailable, PermanentError):
    """Raised when the global concurrency limit does not exist: strict, so actions stop until it does."""


@contextmanager
def node_actions_slot(holder: UUID, wait_seconds: float = WAIT_SECONDS) -> Iterator[None]:
    """Hold the one `medic-node-actions` slot, as flow run `holder`."""
    with _client() as client:
        lease = acquire(client, holder, time.monotonic() + wait_seconds)
        released = threading.Event()
        # In the caller's context: Prefect's settings (its API URL among them) may be set in-process,
        # and a thread started bare would renew on a temporary server of its own.
        renewing = threading.Thread(
            target=contextvars.copy_context().run,
            args=(_renew, lease, released),
            name="medic-slot-lease",
            daemon=True,
        )
        renewing.start()
        try:
            yield
        finally:
            released.set()
            renewing.join()
            client.release_concurrency_slots_with_lease(lease)
            FREED.notify()


def _renew(lease: UUID, released: threading.Event) -> None:
    """Keep the lease while the slot is held; its own client, as a client is not shared across
    threads, made only once a renewal is due (most holds end well before: no cost to them)."""
    if released.wait(LEASE_SECONDS / 3):
        return
    with _client() as client:
        while True:
            try:
                client.renew_concurrency_lease(lease, LEASE_SECONDS)
            except httpx.HTTPError:  # the API is briefly away: the next renewal may still be in time
                log.warning("renewing the %s lease failed", NODE_ACTIONS_LIMIT, exc_info=True)
            if released.wait(LEASE_SECONDS / 3):
                return


def _client() -> SyncPrefectClient:
    """Prefect's sync client; on a plain-HTTP API (the embedded server's, a server in the cluster
    network) without the TLS context Prefect loads certificates into for every client, a tenth of
    a second on a busy machine, in the path from a fault to its drain."""
    url = PREFECT_API_URL.value()
    plain = url is None or url.startswith("http://")
    return get_client(sync_client=True, httpx_settings={"verify": _unused_tls()} if plain else None)


@functools.cache
def _unused_tls() -> ssl.SSLContext:
    return ssl.create_default_context()


class _Freed:
    """Slots this process let go of, counted, with its waiters woken at each. A run or containment
    waiting behind another's node action in the same process (every run of the embedded default,
    a replica's in-process runs) asks again the moment the slot comes free, instead of sleeping
    out the pause Prefect's Retry-After sets (up to MAX_PAUSE_S) between a fault and its drain.
    Slots freed by other processes are still found by asking again after the pause."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self.count = 0

    def notify(self) -> None:
        with self._condition:
            self.count += 1
            self._condition.notify_all()

    def wait(self, seconds: float, seen: int) -> None:
        """Sleep `seconds`, or less when a slot is freed here after `seen` frees (at once if one was)."""
        with self._condition:
            if self.count == seen:
                self._condition.wait(seconds)


FREED = _Freed()


def acquire(client: SyncPrefectClient, holder: UUID, deadline: float) -> UUID:
    pause = 0.02
    while True:
        seen = FREED.count  # before asking: a slot freed while the answer comes back wakes the wait
        try:
            return _lease_of(_increment(client, holder))
        except httpx.HTTPStatusError as error:
            if error.response.status_code not in BUSY:
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise SlotBusy(f"no {NODE_ACTIONS_LIMIT} slot within the wait") from error
            FREED.wait(min(_retry_after(error.response, pause), MAX_PAUSE_S, left), seen)
        except httpx.TransportError:
            # No answer: a pooled connection the server closed as the request went out (a keep-alive
            # race, seen under load), or the API briefly away. Prefect's own client sends these again,
            # and so does this loop until the wait is over. Should a lease have been granted and its
            # answer lost, the slot only looks busy until that lease expires: no action is taken twice.
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            FREED.wait(min(pause, left), seen)
        pause = min(pause * 2, 1.0)


def _increment(client: SyncPrefectClient, holder: UUID) -> httpx.Response:
    """One try for the slot (`increment_concurrency_slots_with_lease`'s request), sent past the
    client's retry wrapper: even with its retries off, that sleeps 2 s after a busy answer before
    handing it back, and `acquire` asks again after milliseconds."""
    body = {
        "names": [NODE_ACTIONS_LIMIT],
        "slots": 1,
        "mode": "concurrency",
        "lease_duration": LEASE_SECONDS,
        "holder": ConcurrencyLeaseHolder(type="flow_run", id=holder).model_dump(mode="json"),
    }
    http = client._client  # Prefect's httpx client: its API's base URL, headers and auth
    response = httpx.Client.send(http, http.build_request("POST", INCREMENT_PATH, json=body))
    response.raise_for_status()
    return response


def _lease_of(response: httpx.Response) -> UUID:
    body = response.json()
    if not body.get("limits"):  # strict: a deleted limit must stop actions, not unleash them
        raise SlotLimitMissing(f"the global concurrency limit {NODE_ACTIONS_LIMIT} does not exist")
    return UUID(body["lease_id"])


def _retry_after(response: httpx.Response, default: float) -> float:
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return default
