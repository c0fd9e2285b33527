"""A process stopped while its chat messages wait for Slack does not take them along (issue 41): they
are in the store's outbox, and the next start sends every one, once, in order, with its step."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from audit_support import sql
from checkout import REPO_ROOT
from factories import fault_event
from slack_api import SlackApi, running_slack_api
from slack_sdk import WebClient
from sqlalchemy import update
from sqlmodel import col
from test_notify_background import Scripted

from medic.flows.live import LiveDispatcher
from medic.integrations import registry
from medic.integrations.slack.notifier import SlackNotifier
from medic.protocols import Message
from medic.statuses import IncidentStatus, MessageStatus, StepStatus
from medic.store import Store, utcnow
from medic.store.tables import OutboxRecord, StepRecord
from medic.tasks.notify import redeliver
from medic.tasks.runtime.process import Runtime, configure

SLACK_TOKEN = "xoxb-test-token"
CHANNEL_ID = "C0GPUOPS"
DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"

# A process running one incident's flow, its chat through Slack's Web API at argv[2]. Like `medic serve`,
# it runs the flow on a worker thread, and on SIGTERM stops as serve does (medic/apps/server/main.py): its
# on_stop says what is left, then it ends at once.
RUN = """
import asyncio, logging, os, signal, sys, threading

from slack_sdk import WebClient

from medic.flows.dispatch import remediate_all
from medic.intake import read_lines
from medic.integrations import registry
from medic.integrations.sim.fleet import SimFleet
from medic.integrations.slack.notifier import SlackNotifier
from medic.store import Store
from medic.tasks.notify import left_behind
from medic.tasks.runtime.process import Runtime, configure

url, api_url, token, policy, event = sys.argv[1:]
backends, fleet = registry.simulated(SimFleet.build(nodes=8))
client = WebClient(token=token, base_url=api_url, retry_handlers=[], timeout=5)
backends.notifier = SlackNotifier(client, max_wait_s=1)
fleet.add_job("llm", "alice", ["gpu-node-1", "gpu-node-2"], step=1_234, checkpoint_every=100)
fleet.crash_job("llm")
rt = configure(Runtime(Store(url), backends, policy))


def stop(signum, _frame):
    left_behind()
    logging.shutdown()
    os._exit(128 + signum)


signal.signal(signal.SIGTERM, stop)
flow = threading.Thread(target=asyncio.run, args=(remediate_all(rt, read_lines([event], "events.jsonl")),))
flow.start()
flow.join()
"""


@pytest.fixture
def slack_api() -> Iterator[SlackApi]:
    with running_slack_api(SLACK_TOKEN, {"gpu-ops": CHANNEL_ID}) as api:
        yield api


def closed_incident(store: Store, run: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and run.poll() is None:
        for incident in store.find_incidents(node="gpu-node-1"):
            if incident.status == IncidentStatus.CLOSED:
                return incident.id
        time.sleep(0.05)
    raise AssertionError(f"no closed incident within {timeout_s} s: {log.read_text()[-5000:]}")


def pending(store: Store) -> int:
    return int(sql(store, "SELECT count(*) FROM outbox WHERE status = 'pending'"))


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_messages_left_by_a_stop_in_the_final_flush_are_sent_by_the_next_start(
    sqlite_store: Store,
    slack_api: SlackApi,
    live_dispatcher: Callable[[Runtime], LiveDispatcher],
    tmp_path: Path,
    stop: signal.Signals,
) -> None:
    from prefect.settings import PREFECT_API_URL

    event = fault_event(id="outbox-1", node="gpu-node-1", gpu=3, job="llm", at=datetime.now(UTC))
    env = os.environ | {"PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_HOME": str(tmp_path)}
    args = [sqlite_store.url, slack_api.api_url, SLACK_TOKEN, str(DEFAULT_POLICY), event.model_dump_json()]
    slack_api.go_down(503)
    log = tmp_path / "run.log"  # a file, not a pipe: nothing reads while the run writes
    with log.open("w") as out:
        run = subprocess.Popen([sys.executable, "-c", RUN, *args], env=env, stderr=out)
    try:
        incident = closed_incident(sqlite_store, run, log)  # every message said: the run waits for chat
        time.sleep(0.5)  # into the final flush (10 s)
        assert run.poll() is None, "the run ended before its final flush did"
        run.send_signal(stop)
        run.wait(timeout=30)
    finally:
        run.kill()
    stderr = log.read_text()
    assert run.returncode == (128 + stop if stop == signal.SIGTERM else -stop), stderr[-5000:]
    assert pending(sqlite_store) == 5 and slack_api.posted(CHANNEL_ID) == []
    if stop == signal.SIGTERM:
        assert "5 message(s) left in the outbox for the next start" in stderr

    # The next start, with Slack back: its first pickup sends them again.
    slack_api.come_back()
    backends, _ = registry.simulated()
    backends.notifier = SlackNotifier(
        WebClient(token=SLACK_TOKEN, base_url=slack_api.api_url, retry_handlers=[], timeout=5)
    )
    asyncio.run(live_dispatcher(configure(Runtime(sqlite_store, backends, DEFAULT_POLICY))).pickup())
    deadline = time.monotonic() + 30
    while pending(sqlite_store) and time.monotonic() < deadline:
        time.sleep(0.05)

    head, *replies = slack_api.posted(CHANNEL_ID)
    assert head["text"].startswith("Hardware fault on gpu-node-1: reboot") and "thread_ts" not in head
    assert {r["thread_ts"] for r in replies} == {head["ts"]}
    prefixes = ["Decision: reboot", "Job llm resumed from step 1200", "DCGM level 1 passed", "Closed: "]
    assert [r["text"][: len(p)] for r, p in zip(replies, prefixes, strict=True)] == prefixes
    detail = sqlite_store.incident_detail(incident)
    assert detail is not None
    chat = [(s.stage, s.status, (s.detail or {}).get("redelivered")) for s in detail.steps]
    assert [c for c in chat if c[0] in ("notify", "update")] == [("notify", "ok", True)] + [
        ("update", "ok", True)
    ] * 4


def test_the_next_start_replies_in_the_thread_posted_before_and_gives_up_what_must_not_go_out(
    sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("medic.tasks.notify.BACKOFF_S", (0.05,))
    backends, _ = registry.simulated()
    backends.notifier = notifier = Scripted()
    rt = configure(Runtime(sqlite_store, backends, DEFAULT_POLICY))

    def said(
        incident: str, text: str = "", parent: int | None = None, approval_run: str | None = None
    ) -> int:
        """Said by a process of another host that died: its hold lapsed."""
        head = Message(incident=incident, channel="#gpu-ops", title=text, body="", approval_run=approval_run)
        return sqlite_store.queue_message(
            incident,
            "update" if parent else "notify",
            message=None if parent else asdict(head),
            text=text if parent else "",
            parent_id=parent,
            owner="other-host:notify:41",
            lease_s=-1,
        )

    posted = said("inc-posted", "Hardware fault")  # posted before the process died; its reply was not
    step = StepRecord(
        incident_id="inc-posted",
        stage="notify",
        started_at=utcnow(),
        finished_at=utcnow(),
        status=StepStatus.OK,
        summary="posted",
    )
    sqlite_store.settle_message(posted, MessageStatus.DELIVERED, tries=1, error="", ref="C1:7", step=step)
    said("inc-posted", "Closed", parent=posted)
    said("inc-old", "Closed", parent=said("inc-old", "Hardware fault"))
    with sqlite_store.engine.begin() as connection:  # said a day ago
        connection.execute(
            update(OutboxRecord)
            .where(col(OutboxRecord.incident_id) == "inc-old")
            .values(created_at=utcnow() - timedelta(hours=25))
        )
    said("inc-ask", "Approval needed: reboot gpu-node-1", approval_run="run-1")

    assert redeliver(rt) == 4
    deadline = time.monotonic() + 10
    while pending(sqlite_store) and time.monotonic() < deadline:
        time.sleep(0.05)

    assert notifier.sent == [("C1:7", "Closed")]
    steps = {
        incident: [(s.stage, s.status, s.summary) for s in sqlite_store.steps_of(incident)]
        for incident in ("inc-posted", "inc-old", "inc-ask")
    }
    assert steps == {
        "inc-posted": [("notify", "ok", "posted"), ("update", "ok", "Closed")],
        "inc-old": [
            ("notify", "failed", "'Hardware fault' not delivered: pending for more than 24 h"),
            ("update", "failed", "'Closed' not delivered: the message it replies to was not delivered"),
        ],
        "inc-ask": [
            (
                "notify",
                "failed",
                "'Approval needed: reboot gpu-node-1' not delivered: "
                "an approval request whose flow run ended with the process that said it",
            )
        ],
    }
