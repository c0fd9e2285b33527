"""Chat never holds a node out of service: an incident's messages go out in order from a worker of
their own, tried again while the chat is down, and the run waits for them only at its very end,
for at most medic/tasks/notify.py's FLUSH_S. What never gets through is recorded and logged."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from checkout import REPO_ROOT
from factories import fault_event
from slack_api import SlackApi, running_slack_api
from slack_sdk import WebClient

from medic.flows.dispatch import Dispatch, remediate_all
from medic.intake import read_lines
from medic.integrations import registry
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.slack.notifier import NotifyRefusedError, NotifyUnavailableError, SlackNotifier
from medic.protocols import Message, NodeState
from medic.store import Store
from medic.store.tables import StepRecord
from medic.tasks.notify import IncidentThread
from medic.tasks.runtime.process import Runtime, configure

SLACK_TOKEN = "xoxb-test-token"
CHANNEL_ID = "C0GPUOPS"
DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"


def head(incident: str, title: str = "Hardware fault on gpu-node-1: reboot") -> Message:
    return Message(incident=incident, channel="#gpu-ops", title=title, body="XID 79")


class Scripted:
    """A notifier that fails its first `failures` calls with `error`, then records every message."""

    def __init__(self, failures: int = 0, error: Exception | None = None) -> None:
        self.failures, self.error = failures, error or NotifyUnavailableError("Slack is down")
        self.sent: list[tuple[str, str]] = []  # (thread, text); the head's thread is ""
        self.calls = 0
        self._lock = threading.Lock()

    def post(self, message: Message) -> str:
        self._call()
        self.sent.append(("", message.title))
        return f"C1:{len(self.sent)}"

    def reply(self, thread: str, text: str) -> None:
        self._call()
        self.sent.append((thread, text))

    def _call(self) -> None:
        with self._lock:
            self.calls += 1
            if self.calls <= self.failures:
                raise self.error


@pytest.fixture
def scripted_runtime(sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> Runtime:
    monkeypatch.setattr("medic.tasks.notify.BACKOFF_S", (0.05,))
    backends, _ = registry.simulated()
    return configure(Runtime(sqlite_store, backends, DEFAULT_POLICY))


def steps(store: Store, incident: str) -> list[StepRecord]:
    detail = store.incident_detail(incident)
    return detail.steps if detail else []


def test_messages_are_queued_at_once_and_sent_in_order_through_failures(
    scripted_runtime: Runtime, sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Saying the messages while the chat fails three times: waiting on it would take three back-offs
    # (0.9 s); queueing them takes four writes to the store, well under that even on a loaded machine.
    monkeypatch.setattr("medic.tasks.notify.BACKOFF_S", (0.3,))
    notifier = Scripted(failures=3)
    scripted_runtime.backends.notifier = notifier
    sqlite_store.open_incident(_incident("inc-order"))

    async def story() -> tuple[float, bool]:
        thread = IncidentThread("inc-order", head("inc-order"))
        started = time.perf_counter()
        for text in ("Decision: reboot", "Job llm resumed", "DCGM level 1 passed", "Closed"):
            await thread.say(text)
        said = time.perf_counter() - started
        return said, await thread.flush(5)

    said, delivered = asyncio.run(story())
    assert said < 0.6  # nothing waited on the chat
    assert delivered
    assert notifier.sent == [
        ("", "Hardware fault on gpu-node-1: reboot"),
        ("C1:1", "Decision: reboot"),
        ("C1:1", "Job llm resumed"),
        ("C1:1", "DCGM level 1 passed"),
        ("C1:1", "Closed"),
    ]
    recorded = [(s.stage, s.status, (s.detail or {}).get("tries")) for s in steps(sqlite_store, "inc-order")]
    assert recorded == [("notify", "ok", 4)] + [("update", "ok", 1)] * 4


def test_a_refused_message_and_its_replies_are_recorded_as_failed_not_dropped(
    scripted_runtime: Runtime, sqlite_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = Scripted(
        failures=1, error=NotifyRefusedError("Slack refused chat.postMessage: channel_not_found")
    )
    scripted_runtime.backends.notifier = notifier
    sqlite_store.open_incident(_incident("inc-refused"))

    async def story() -> bool:
        thread = IncidentThread("inc-refused", head("inc-refused"))
        await thread.say("Decision: reboot")
        await thread.say("Closed")
        return await thread.flush(5)

    started = time.perf_counter()
    assert asyncio.run(story()) is False
    assert time.perf_counter() - started < 1  # a refusal is not tried again
    assert notifier.sent == []
    failed = [(s.stage, s.status, s.summary) for s in steps(sqlite_store, "inc-refused")]
    assert [f[:2] for f in failed] == [("notify", "failed"), ("update", "failed"), ("update", "failed")]
    assert "refused: NotifyRefusedError: Slack refused chat.postMessage: channel_not_found" in failed[0][2]
    assert "the message it replies to was not delivered" in failed[1][2]
    assert len([r for r in caplog.records if "not delivered" in r.getMessage()]) == 3


def test_the_final_flush_is_bounded_and_gives_up_what_is_left(
    scripted_runtime: Runtime, sqlite_store: Store
) -> None:
    scripted_runtime.backends.notifier = Scripted(failures=10**6)
    sqlite_store.open_incident(_incident("inc-never"))

    async def story() -> bool:
        thread = IncidentThread("inc-never", head("inc-never"))
        await thread.say("Closed")
        return await thread.flush(0.3)

    started = time.perf_counter()
    assert asyncio.run(story()) is False
    # Unbounded, it would never end (a million failures to retry). The 0.3 s plus the give-up's records
    # took 1.5 s once with the whole suite loading both cores: the bound leaves room for that.
    assert time.perf_counter() - started < 3
    failed = [(s.stage, s.status, s.summary) for s in steps(sqlite_store, "inc-never")]
    assert [f[:2] for f in failed] == [("notify", "failed"), ("update", "failed")]
    assert (
        "not delivered within the run's final 0.3 s flush; last error: NotifyUnavailableError" in failed[0][2]
    )


def test_a_second_message_of_the_incident_waits_behind_the_first(
    scripted_runtime: Runtime, sqlite_store: Store
) -> None:
    """The approval request (medic/flows/approval.py) goes out after the incident's own message."""
    notifier = Scripted(failures=2)
    scripted_runtime.backends.notifier = notifier
    sqlite_store.open_incident(_incident("inc-two"))

    async def story() -> bool:
        thread = IncidentThread("inc-two", head("inc-two"))
        await thread.open()
        ask = IncidentThread("inc-two", head("inc-two", "Approval needed: replace gpu-node-1"))
        sent = await ask.delivered(5)
        await ask.say("approved by U0ALICE1 via slack")
        await thread.flush(5)
        return sent

    assert asyncio.run(story())
    assert notifier.sent == [
        ("", "Hardware fault on gpu-node-1: reboot"),
        ("", "Approval needed: replace gpu-node-1"),
        ("C1:2", "approved by U0ALICE1 via slack"),
    ]


def _incident(incident_id: str) -> Any:
    from medic.incidents import Incident

    return Incident(id=incident_id, node="gpu-node-1", events=[fault_event(id=f"{incident_id}-e")])


# --- the real flow on Prefect, Slack's Web API down ------------------------------------------


@pytest.fixture
def slack_api() -> Iterator[SlackApi]:
    with running_slack_api(SLACK_TOKEN, {"gpu-ops": CHANNEL_ID}) as api:
        yield api


@pytest.fixture
def training(sqlite_store: Store, slack_api: SlackApi) -> Iterator[tuple[Runtime, SimFleet]]:
    backends, fleet = registry.simulated(SimFleet.build(nodes=8))
    backends.notifier = SlackNotifier(
        WebClient(token=SLACK_TOKEN, base_url=slack_api.api_url, retry_handlers=[], timeout=5)
    )
    fleet.add_job("llm", "alice", ["gpu-node-1", "gpu-node-2"], step=1_234, checkpoint_every=100)
    fleet.crash_job("llm")
    yield configure(Runtime(sqlite_store, backends, DEFAULT_POLICY)), fleet


def xid79() -> list[str]:
    event = fault_event(id="bg-1", node="gpu-node-1", gpu=3, job="llm", at=datetime.now(UTC))
    return [event.model_dump_json()]


def in_background(rt: Runtime) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def target() -> None:
        result["dispatch"] = asyncio.run(remediate_all(rt, read_lines(xid79(), "t.jsonl")))
        result["ended"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def wait_for_step(store: Store, stage: str, timeout_s: float = 60) -> StepRecord:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for incident in store.find_incidents(node="gpu-node-1"):
            found = [s for s in steps(store, incident.id) if s.stage == stage]
            if found:
                return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no {stage} step within {timeout_s} s")


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize(("status", "retry_after"), [(503, None), (429, "1")], ids=["503", "ratelimited"])
def test_the_node_is_back_in_seconds_while_slack_is_down_and_the_thread_arrives_in_order(
    training: tuple[Runtime, SimFleet], slack_api: SlackApi, status: int, retry_after: str | None
) -> None:
    rt, fleet = training
    slack_api.go_down(status, retry_after)
    thread, result = in_background(rt)
    verified = wait_for_step(rt.store, "verify L1")
    # Back in service, verified, and not one message has reached Slack yet: nothing waited on it.
    assert fleet.nodes["gpu-node-1"].state is NodeState.IDLE
    assert slack_api.posted(CHANNEL_ID) == []
    slack_api.come_back()
    thread.join(timeout=60)

    dispatch: Dispatch = result["dispatch"]
    (outcome,) = dispatch.outcomes
    assert (outcome.action, outcome.act, outcome.notified) == ("reboot", "done", True)
    acted = next(s for s in steps(rt.store, outcome.incident) if s.stage == "act: reboot")
    out_of_service_s = (verified.finished_at - acted.started_at).total_seconds()
    assert out_of_service_s < 3, out_of_service_s
    # Slack said no meanwhile, as asked; then the head and its replies, in the order they were said.
    assert {r.status for r in slack_api.requests} >= {status, 200}
    head_message, *replies = slack_api.posted(CHANNEL_ID)
    assert head_message["text"].startswith("Hardware fault on gpu-node-1: reboot")
    assert "thread_ts" not in head_message
    assert {r["thread_ts"] for r in replies} == {head_message["ts"]}
    prefixes = ["Decision: reboot", "Job llm resumed from step 1200", "DCGM level 1 passed", "Closed: "]
    assert [r["text"][: len(p)] for r, p in zip(replies, prefixes, strict=True)] == prefixes
    chat = [(s.stage, s.status) for s in steps(rt.store, outcome.incident) if s.stage in ("notify", "update")]
    assert chat == [("notify", "ok")] + [("update", "ok")] * 4


@pytest.mark.usefixtures("prefect_harness")
def test_slack_down_for_good_costs_the_run_at_most_the_final_flush(
    training: tuple[Runtime, SimFleet], slack_api: SlackApi
) -> None:
    rt, fleet = training
    notifier = rt.backends.notifier
    assert isinstance(notifier, SlackNotifier)
    notifier.max_wait_s = 2  # each try gives up soon, so the last one ends soon after the run
    slack_api.go_down(503)
    thread, result = in_background(rt)
    wait_for_step(rt.store, "verify L1")
    back = time.monotonic()
    thread.join(timeout=60)

    (outcome,) = result["dispatch"].outcomes
    assert (outcome.action, outcome.act, outcome.notified) == ("reboot", "done", False)
    assert fleet.nodes["gpu-node-1"].state is NodeState.IDLE
    finished = rt.store.get_incident(outcome.incident)
    assert finished is not None and finished.status == "closed"
    # The run ended at most the final flush (10 s) after the node was back, plus Prefect's own time.
    assert result["ended"] - back < 11, result["ended"] - back
    # What never got through is on record: the message still in a call settles when the call ends.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not [
        s for s in steps(rt.store, outcome.incident) if s.stage == "notify"
    ]:
        time.sleep(0.1)
    chat = [(s.stage, s.status) for s in steps(rt.store, outcome.incident) if s.stage in ("notify", "update")]
    assert sorted(chat) == [("notify", "failed")] + [("update", "failed")] * 4


def test_the_final_flush_tries_again_at_once_rather_than_wait_out_a_long_pause(
    scripted_runtime: Runtime, sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("medic.tasks.notify.BACKOFF_S", (30.0,))  # as after minutes of an outage
    notifier = Scripted(failures=2)
    scripted_runtime.backends.notifier = notifier
    sqlite_store.open_incident(_incident("inc-pause"))

    async def story() -> bool:
        thread = IncidentThread("inc-pause", head("inc-pause"))
        await thread.say("Closed")
        await asyncio.sleep(0.2)  # the first try failed; the worker pauses for 30 s
        return await thread.flush(5)

    started = time.perf_counter()
    assert asyncio.run(story())
    assert time.perf_counter() - started < 3  # tries at once, then every CLOSING_PAUSE_S
    assert [text for _, text in notifier.sent] == ["Hardware fault on gpu-node-1: reboot", "Closed"]
