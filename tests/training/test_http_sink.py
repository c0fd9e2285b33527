"""The hooks' HTTP sink (medic/training/medic_hooks.py, HttpSink): authenticated as GPU Medic's other
senders are, off the training step's path, in batches, retried while GPU Medic is away and bounded
meanwhile, each refusal said once. Against a real HTTP server (the standard library's) that answers as
told; `medic serve` itself: tests/entrypoints/test_hooks_to_serve.py."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from torchrun_support import free_port

from medic.events import FaultEvent
from medic.training.medic_hooks import (
    FLUSH_S,
    JOB_HEADER,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    HttpSink,
    MedicHooks,
    token_from,
)

JOB, NODE = "llm-7b", "gpu-node-07"


@dataclass
class Intake:
    """What the server saw, and how it answers: `answers` in turn (then 202), after `delay_s`."""

    answers: list[tuple[int, dict[str, str], bytes]] = field(default_factory=list)
    delay_s: float = 0.0
    requests: list[tuple[dict[str, str], list[dict[str, object]]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def lines(self) -> list[dict[str, object]]:
        return [line for _, body in self.requests for line in body]


def handler_for(intake: Intake) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(intake.delay_s)
            with intake.lock:
                intake.requests.append((dict(self.headers), [json.loads(x) for x in body.splitlines()]))
                status, headers, answer = intake.answers.pop(0) if intake.answers else (202, {}, b"{}")
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def intake() -> Iterator[tuple[Intake, str]]:
    state = Intake()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_port}/v1/events"
    server.shutdown()
    server.server_close()


def hooks(sink: HttpSink, rank: int = 0) -> MedicHooks:
    return MedicHooks(job=JOB, node=NODE, rank=rank, sink=sink)


def test_the_token_comes_from_a_file_or_the_environment_never_the_url(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-a-file\n")
    assert token_from({TOKEN_FILE_ENV: str(secret), TOKEN_ENV: "from-env"}) == "from-a-file"
    assert token_from({TOKEN_ENV: "from-env"}) == "from-env"
    assert token_from({}) is None
    assert token_from({TOKEN_FILE_ENV: str(tmp_path / "missing")}) is None  # said, and sent without


def test_each_batch_is_one_authenticated_post_of_json_lines(
    intake: tuple[Intake, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state, url = intake
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    state.delay_s = 0.3  # the first request is under way while the rest queue
    sink = HttpSink(url)
    rank = hooks(sink)
    sent = [rank.event("nan_loss", iteration=0, loss="nan")]
    time.sleep(0.1)  # its request is under way
    sent += [rank.event("nan_loss", iteration=i, loss="nan") for i in range(1, 40)]
    assert sink.flush(10)
    assert [line["id"] for line in state.lines()] == [e.id for e in sent]  # all, in order
    assert len(state.requests) <= 2  # what queued behind the first went as one batch
    for headers, body in state.requests:
        assert headers["Authorization"] == "Bearer s3cret"
        assert headers["Content-Type"] == "application/x-ndjson"
        assert headers[JOB_HEADER] == JOB
        for line in body:
            FaultEvent.model_validate(line)
    assert "s3cret" not in sink.url


def test_a_slow_intake_never_holds_the_step(intake: tuple[Intake, str]) -> None:
    state, url = intake
    state.delay_s = 2.0  # GPU Medic answering in 2 s
    sink = HttpSink(url, token="t")
    rank = MedicHooks(job=JOB, node=NODE, rank=0, sink=sink, world_size=2, timings_every=1)
    began = time.perf_counter()
    for step in range(200):
        rank.step(step, 1.0, 0.1)  # a step-timings report each step
    took = time.perf_counter() - began
    assert took < 1.0, f"200 steps took {took:.2f} s beside a 2 s intake"
    assert sink.flush(15)
    assert len(state.lines()) == 200 and len(state.requests) < 20


def test_a_passing_failure_is_tried_again_and_its_events_kept_in_order(
    intake: tuple[Intake, str], caplog: pytest.LogCaptureFixture
) -> None:
    state, url = intake
    state.answers = [
        (503, {"Retry-After": "0"}, b'{"error": "the store does not answer"}'),
        (429, {}, b"{}"),
    ]
    sink = HttpSink(url, token="t")
    rank = hooks(sink)
    sent = [rank.event("nan_loss", iteration=i, loss="nan") for i in range(3)]
    assert sink.flush(10)
    assert [line["id"] for _, body in state.requests[2:] for line in body] == [e.id for e in sent]
    assert sink.delivered == 3 and sink.dropped == sink.refused == 0
    assert caplog.text.count("trying again in the background") == 1  # once per outage
    assert "again after 2 failed tries" in caplog.text


def test_a_refusal_is_said_once_with_the_reason_and_not_sent_again(
    intake: tuple[Intake, str], caplog: pytest.LogCaptureFixture
) -> None:
    state, url = intake
    refused = (401, {}, b'{"error": "a bearer token or an X-Medic-Signature is required"}')
    state.answers = [refused] * 5
    sink = HttpSink(url, token="wrong")
    rank = hooks(sink)
    for i in range(5):
        rank.event("nan_loss", iteration=i, loss="nan")
        assert sink.flush(5)  # a batch each
    assert len(state.requests) == 5 and sink.refused == 5 and sink.delivered == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "HTTP 401 a bearer token or an X-Medic-Signature is required" in errors[0]
    assert TOKEN_FILE_ENV in errors[0] and "wrong" not in errors[0]


def test_while_the_intake_is_away_the_queue_keeps_the_newest_and_says_what_it_dropped(
    intake: tuple[Intake, str], caplog: pytest.LogCaptureFixture
) -> None:
    state, url = intake
    state.answers = [(503, {}, b"{}")] * 3  # away for three tries: about 3.5 s of pauses
    sink = HttpSink(url, token="t", max_queue=10, max_batch=10)
    rank = hooks(sink)
    sent = [rank.event("nan_loss", iteration=i, loss="nan") for i in range(25)]
    assert sink.flush(15)
    delivered = [line["id"] for _, body in state.requests[3:] for line in body]
    assert delivered == [e.id for e in sent[-10:]]
    assert sink.dropped == 15
    assert "15 event(s) dropped meanwhile" in caplog.text


def test_an_unreachable_intake_costs_the_step_nothing_and_the_crash_waits_briefly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = HttpSink(f"http://127.0.0.1:{free_port()}/v1/events", token="t")
    rank = hooks(sink)
    began = time.perf_counter()
    for i in range(100):
        rank.event("nan_loss", iteration=i, loss="nan")
    assert time.perf_counter() - began < 0.5
    began = time.perf_counter()
    rank.crash(2)
    took = time.perf_counter() - began
    assert FLUSH_S - 0.5 <= took < FLUSH_S + 2, took  # waits for GPU Medic, bounded, then ends
    assert caplog.text.count("could not deliver events") == 1


def test_a_crash_is_delivered_before_crash_returns(intake: tuple[Intake, str]) -> None:
    state, url = intake
    state.delay_s = 0.5
    event = hooks(HttpSink(url, token="t")).crash(134)
    assert [line["id"] for line in state.lines()] == [event.id]
