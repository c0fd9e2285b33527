"""medic/training/medic_hooks.py: the events a training loop reports, read back as FaultEvents.

The hook library builds its events with the standard library only; these tests hold it to the
domain model: every line it writes must validate as a `medic.events.FaultEvent` and be the very
document `FaultEvent.model_dump_json()` writes for it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchrun_support import TRAINING_DIR, free_port

from medic.events import EventKind, FaultEvent
from medic.training.medic_hooks import Event, Kind, MedicHooks

JOB, NODE, RANK = "llm-7b", "gpu-node-07", 3


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sink(tmp_path: Path) -> Path:
    return tmp_path / "events.jsonl"


def hooks_for(sink: Path | str, **options: object) -> MedicHooks:
    return MedicHooks(job=JOB, node=NODE, rank=RANK, sink=sink, **options)  # type: ignore[arg-type]


def written(sink: Path) -> list[FaultEvent]:
    if not sink.exists():
        return []
    return [FaultEvent.model_validate_json(line) for line in sink.read_text().splitlines()]


def domain(events: list[Event]) -> list[FaultEvent]:
    """What the library returned, as the domain model reads it."""
    return [FaultEvent.model_validate_json(event.to_json()) for event in events]


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_loss_is_a_nan_loss_event(sink: Path, loss: float) -> None:
    hooks = hooks_for(sink, gpu=5)
    assert hooks.step(41, 2.5, 0.2) == []
    reported = hooks.step(42, loss, 0.2)
    [event] = written(sink)
    assert domain(reported) == [event]
    assert (event.kind, event.iteration, event.rank, event.job, event.node, event.gpu, event.source) == (
        EventKind.NAN_LOSS,
        42,
        RANK,
        JOB,
        NODE,
        5,
        "job",
    )
    assert event.attributes == {"loss": str(loss)}


def test_a_slow_step_is_a_straggler_event_at_most_once_per_cooldown(sink: Path) -> None:
    clock = Clock()
    hooks = hooks_for(sink, straggler_ratio=1.2, min_history=5, straggler_cooldown_s=60, clock=clock)
    assert hooks.step(1, 1.0, 9.0) == []  # slow, but there is no baseline yet
    for step in range(2, 7):
        assert hooks.step(step, 1.0, 1.0) == []
    [event] = hooks.step(7, 1.0, 1.5)
    assert (event.kind, event.iteration, event.rank) == (EventKind.STRAGGLER, 7, RANK)
    assert event.attributes["step_time_ratio"] == 1.5
    assert event.attributes["median_step_time_s"] == 1.0

    clock.now += 30
    assert hooks.step(8, 1.0, 2.0) == []  # still cooling down
    clock.now += 31
    [again] = hooks.step(9, 1.0, 2.0)
    assert again.attributes["step_time_ratio"] == 2.0
    assert hooks.step(10, 1.0, 1.1) == []  # below the ratio
    assert written(sink) == domain([event, again])


def test_millisecond_steps_are_never_stragglers(sink: Path) -> None:
    hooks = hooks_for(sink)
    for step in range(1, 10):
        hooks.step(step, 1.0, 0.001)
    assert hooks.step(10, 1.0, 0.01) == []  # 10x the median, but timer noise at this scale


def test_crash_reports_the_exit_code_and_last_step(sink: Path) -> None:
    hooks = hooks_for(sink)
    hooks.step(12, 0.5, 1.0)
    event = hooks.crash(137)
    assert written(sink) == domain([event])
    assert (event.kind, event.iteration, event.attributes) == (EventKind.JOB_CRASH, 12, {"exit_code": 137})


def test_a_real_gloo_timeout_is_an_nccl_timeout_event(sink: Path) -> None:
    # Two gloo ranks in one process; rank 1 never joins the all-reduce, so rank 0 times out.
    store = dist.HashStore()
    groups: dict[int, dist.ProcessGroupGloo] = {}

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=0.3))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    hooks = hooks_for(sink)
    hooks.step(99, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="Timed out") as raised, hooks.watch():
        groups[0].allreduce([torch.ones(4)]).wait()
    [event] = written(sink)
    assert (event.kind, event.iteration, event.rank) == (EventKind.NCCL_TIMEOUT, 99, RANK)
    assert "Timed out" in event.attributes["message"]
    assert any(event.id in note for note in raised.value.__notes__)  # the traceback says where it went


def test_nccl_errors_and_other_crashes_from_watch(sink: Path) -> None:
    hooks = hooks_for(sink)
    with pytest.raises(dist.DistBackendError), hooks.watch():
        raise dist.DistBackendError("NCCL watchdog: collective operation failed")
    with pytest.raises(ValueError), hooks.watch():
        raise ValueError("bad shape")
    with hooks.watch():
        pass
    nccl, crash = written(sink)
    assert (nccl.kind, nccl.attributes["error"]) == (EventKind.NCCL_TIMEOUT, "DistBackendError")
    assert (crash.kind, crash.attributes) == (
        EventKind.JOB_CRASH,
        {"exit_code": 1, "error": "ValueError", "message": "bad shape"},
    )


def test_the_excepthook_reports_uncaught_errors_once(sink: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[BaseException] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, tb: seen.append(error))
    hooks = hooks_for(sink)
    hooks.install_excepthook()

    fresh = RuntimeError("connection timed out")
    sys.excepthook(RuntimeError, fresh, None)
    try:
        with hooks.watch():
            raise KeyError("x")
    except KeyError as reported:
        sys.excepthook(KeyError, reported, None)  # already reported by watch(): not again
        assert seen == [fresh, reported]
    assert [e.kind for e in written(sink)] == [EventKind.NCCL_TIMEOUT, EventKind.JOB_CRASH]


class _Recorder(BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []
    routed: list[str | None] = []  # each request's X-Medic-Job

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers["Content-Type"], body))
        self.routed.append(self.headers.get("X-Medic-Job"))
        self.send_response(202)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def intake_url() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    _Recorder.received.clear()
    _Recorder.routed.clear()
    yield f"http://127.0.0.1:{server.server_port}/events"
    server.shutdown()
    server.server_close()


def test_the_http_sink_posts_one_json_line(intake_url: str) -> None:
    event = hooks_for(intake_url).crash(2)
    [(path, content_type, body)] = _Recorder.received
    assert (path, content_type) == ("/events", "application/x-ndjson")
    assert body.endswith(b"\n")
    assert body.decode() == event.to_json() + "\n"
    assert [FaultEvent.model_validate_json(body)] == domain([event])


def test_the_http_sink_names_the_job_for_a_load_balancer_to_route_on(intake_url: str) -> None:
    """Replicas behind a load balancer: a job's step timings must all reach one of them."""
    hooks_for(intake_url).crash(2)
    MedicHooks(job="llm\r\nX-Injected: 1", node=NODE, rank=RANK, sink=intake_url).crash(2)
    assert _Recorder.routed == [JOB, None]  # a name no header can carry: sent, without it
    assert len(_Recorder.received) == 2


def test_an_unreachable_intake_does_not_stop_training(caplog: pytest.LogCaptureFixture) -> None:
    hooks = hooks_for(f"http://127.0.0.1:{free_port()}/events")
    hooks.crash(2)
    assert "could not deliver events to" in caplog.text


# The contract with the consumer: the library writes exactly the documents the domain model does.


def test_every_kind_the_library_emits_is_a_valid_fault_event(sink: Path) -> None:
    clock = Clock()
    hooks = hooks_for(sink, gpu=2, clock=clock)
    returned = [*hooks.step(1, float("nan"), 1.0)]
    for step in range(2, 7):
        returned += hooks.step(step, 1.0, 1.0)
    returned += hooks.step(7, 1.0, 1.7)  # straggler
    returned.append(hooks.crash(137))
    for error in (
        dist.DistBackendError("NCCL watchdog: collective operation failed"),
        RuntimeError("Connection closed by peer: timed out after 1800 s"),
        ValueError("déjà vu: no ASCII here \U0001f525"),
        OSError("an undecodable byte: \udcff"),  # a lone surrogate cannot be UTF-8: replaced, not lost
    ):
        with pytest.raises(type(error)), hooks.watch():
            raise error
    returned.append(
        hooks_for(sink).report_exception(TimeoutError("gloo timed out"))
    )  # job_crash: not a RuntimeError
    returned.append(hooks_for(sink).report_exception(RuntimeError("Timed out waiting for recv")))

    lines = sink.read_text().splitlines()
    assert all(line.isprintable() for line in lines)
    parsed = [FaultEvent.model_validate_json(line) for line in lines]
    # The same document pydantic writes for it: same fields, same nulls, same attributes, same time format.
    assert [event.model_dump_json() for event in parsed] == lines
    returned = [event for event in returned if event is not None]
    assert [event.to_json() for event in returned] == lines[:3] + lines[7:]  # what the methods returned
    assert (
        {event.kind for event in parsed}
        == set(Kind)
        == {
            EventKind.NAN_LOSS,
            EventKind.STRAGGLER,
            EventKind.JOB_CRASH,
            EventKind.NCCL_TIMEOUT,
        }
    )
    assert [event.kind for event in parsed] == [
        EventKind.NAN_LOSS,
        EventKind.STRAGGLER,
        EventKind.JOB_CRASH,
        EventKind.NCCL_TIMEOUT,
        EventKind.NCCL_TIMEOUT,
        EventKind.JOB_CRASH,
        EventKind.JOB_CRASH,
        EventKind.JOB_CRASH,
        EventKind.NCCL_TIMEOUT,
    ]
    for event, line in zip(parsed, lines, strict=True):
        document = json.loads(line)
        assert list(document) == list(FaultEvent.model_fields)  # every field, in the model's order
        assert (document["source"], document["node"], document["job"], document["rank"]) == (
            "job",
            NODE,
            JOB,
            RANK,
        )
        assert document["time"].endswith("Z") and event.time.utcoffset() == timedelta(0)
        assert document["switch"] is None
        typed = event.typed_attributes()  # the per-kind attribute model accepts it
        assert typed.model_dump(mode="json", exclude_none=True) == event.attributes
    assert parsed[0].gpu == 2 and parsed[-1].gpu is None
    assert parsed[1].attributes == {"step_time_ratio": 1.7, "step_time_s": 1.7, "median_step_time_s": 1.0}
    assert parsed[5].attributes["message"] == "déjà vu: no ASCII here \U0001f525"
    assert parsed[6].attributes["message"] == "an undecodable byte: ?"


def test_the_library_kinds_are_domain_kinds() -> None:
    assert {kind.value for kind in Kind} <= {kind.value for kind in EventKind}
    assert all(Kind(kind) == EventKind(kind) for kind in Kind)


def _document(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "id": "ev-1",
        "time": datetime(2025, 3, 1, 12, tzinfo=UTC),
        "source": "job",
        "kind": "straggler",
        "node": NODE,
        "job": JOB,
        "rank": RANK,
        "attributes": {"step_time_ratio": 1.5},
    }
    return {**base, **changes}


@pytest.mark.parametrize(
    "changes",
    [
        {"attributes": {"step_time_ratio": float("inf")}},
        {"attributes": {"step_time_ratio": float("nan")}},
        {"attributes": {"step_time_ratio": 0.0}},
        {"attributes": {"step_time_ratio": -1.5}},
        {"attributes": {}},
        {"kind": "job_crash", "attributes": {}},
        {"kind": "job_crash", "attributes": {"exit_code": "crashed"}},
        {"kind": "xid", "attributes": {"code": 79}},  # not a kind a job reports
        {"time": datetime(2025, 3, 1, 12)},  # no timezone
        {"node": ""},
        {"id": "x" * 201},
        {"job": "j" * 201},
        {"rank": -1},
        {"iteration": -5},
        {"gpu": -1},
    ],
)
def test_an_event_the_schema_rejects_is_never_built(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Event(**_document(**changes))  # type: ignore[arg-type]
    if changes.get("kind") != "xid":  # the domain model does know xid; it rejects the others as well
        with pytest.raises(ValueError):
            FaultEvent.model_validate(_document(**changes))


def test_a_valid_event_is_the_domain_models_document() -> None:
    event = Event(**_document(gpu=0, iteration=7, attributes={"step_time_ratio": 1.5, "note": None}))  # type: ignore[arg-type]
    assert event.attributes == {"step_time_ratio": 1.5}  # None left out, as the model leaves it out
    assert FaultEvent.model_validate_json(event.to_json()).model_dump_json() == event.to_json()


def test_a_non_finite_step_time_is_no_straggler_and_no_error(sink: Path) -> None:
    hooks = hooks_for(sink)
    for step in range(1, 7):
        hooks.step(step, 1.0, 1.0)
    assert hooks.step(7, 1.0, float("inf")) == []
    assert hooks.step(8, 1.0, float("nan")) == []
    assert list(hooks.step_times) == [1.0] * 6  # not part of the baseline either
    assert written(sink) == []


@pytest.mark.parametrize(
    "options",
    [{"rank": -1}, {"node": ""}, {"job": "j" * 201}, {"gpu": -1}, {"straggler_ratio": float("nan")}],
)
def test_a_bad_envelope_fails_when_the_hooks_are_made(sink: Path, options: dict[str, object]) -> None:
    settings: dict[str, object] = {"job": JOB, "node": NODE, "rank": RANK, "sink": sink, **options}
    with pytest.raises(ValueError):
        MedicHooks(**settings)  # type: ignore[arg-type]
    assert not sink.exists()


STANDALONE = (
    "import sys; sys.path.insert(0, sys.argv[1]); import medic_hooks; "
    "bad = [m for m in sys.modules if m.split('.')[0] in ('pydantic', 'medic', 'integrations', 'prefect', 'torch')]; "
    "assert not bad, bad"
)


def test_the_library_imports_the_standard_library_only() -> None:
    # A fresh interpreter: this one has imported pydantic and medic already.
    result = subprocess.run(
        [sys.executable, "-c", STANDALONE, str(TRAINING_DIR)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
