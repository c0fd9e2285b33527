"""A busy answer to the slot's request is asked again after milliseconds: Prefect's client would sleep
2 s after a 503 even with its retries off, and that wait sat between a fault and its drain."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prefect.client.orchestration import SyncPrefectClient

from medic.tasks.nodes.guard import FREED, INCREMENT_PATH, MAX_PAUSE_S, NODE_ACTIONS_LIMIT, acquire

RESET = 0  # an answer of none: the connection reset


class _Busy(BaseHTTPRequestHandler):
    """Answers the slot's request as Prefect's server does: 503 while its database is busy (twice
    here), then the lease."""

    answers: list[int] = []
    bodies: list[dict[str, object]] = []
    held = threading.Event()  # set: another holds the slot (423, come back in 30 s)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append({"path": self.path, **body})
        status = type(self).answers.pop(0) if type(self).answers else 423 if type(self).held.is_set() else 200
        if status == RESET:
            # No answer, the connection reset: what a client sees when the server lets go of a
            # kept-alive connection just as a request goes out on it.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        payload = (
            {"lease_id": str(uuid.uuid4()), "limits": [{"id": str(uuid.uuid4()), "name": NODE_ACTIONS_LIMIT}]}
            if status == 200
            else {"detail": "database is locked"}
        )
        data = json.dumps(payload).encode()
        self.send_response(status)
        if status == 423:
            self.send_header("Retry-After", "30")  # as Prefect's server spreads a busy limit's waiters
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def busy_api() -> Iterator[str]:
    _Busy.answers, _Busy.bodies = [503, 503], []
    _Busy.held.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/api"
    server.shutdown()


def test_a_busy_server_is_asked_again_after_milliseconds(busy_api: str) -> None:
    holder = uuid.uuid4()
    client = SyncPrefectClient(busy_api)
    started = time.monotonic()
    acquire(client, holder, time.monotonic() + 30)
    took = time.monotonic() - started
    assert len(_Busy.bodies) == 3 and took < 1.0  # Prefect's own retry would have slept 2 s and 4 s
    first = _Busy.bodies[0]
    assert first["path"] == "/api" + INCREMENT_PATH
    assert (first["names"], first["slots"], first["mode"]) == ([NODE_ACTIONS_LIMIT], 1, "concurrency")
    assert first["holder"] == {"type": "flow_run", "id": str(holder)}


def test_a_slot_freed_in_this_process_wakes_its_waiter_at_once(busy_api: str) -> None:
    # Another run here holds the slot; the server says to come back in 30 s (asked again after
    # MAX_PAUSE_S at most). Freed here, the slot is asked for again at once.
    _Busy.answers = []
    _Busy.held.set()
    client = SyncPrefectClient(busy_api)
    got: list[float] = []
    started = time.monotonic()
    waiter = threading.Thread(
        target=lambda: (acquire(client, uuid.uuid4(), started + 30), got.append(time.monotonic()))
    )
    waiter.start()
    time.sleep(0.3)
    assert not got and len(_Busy.bodies) == 1  # refused once, and waiting
    _Busy.held.clear()
    freed = time.monotonic()
    FREED.notify()  # as `node_actions_slot` does once its lease is released
    waiter.join(10)
    assert got and got[0] - freed < MAX_PAUSE_S / 2, (
        f"asked again {got and got[0] - freed:.2f} s after the slot came free"
    )
    assert len(_Busy.bodies) == 2


def test_a_connection_reset_is_asked_again_within_the_wait(busy_api: str) -> None:
    _Busy.answers = [RESET, RESET, 503]
    lease = acquire(SyncPrefectClient(busy_api), uuid.uuid4(), time.monotonic() + 30)
    assert lease and len(_Busy.bodies) == 4


def test_connection_resets_for_the_whole_wait_are_not_taken_for_a_slot(busy_api: str) -> None:
    _Busy.answers = [RESET] * 1_000
    with pytest.raises(httpx.TransportError):
        acquire(SyncPrefectClient(busy_api), uuid.uuid4(), time.monotonic() + 0.5)
    assert 2 <= len(_Busy.bodies) < 1_000
