"""Notify: one message per incident, then its story in the thread as the flow moves.

A chat outage never fails remediation: these tasks retry with backoff, and the flow records a
final failure and goes on.
"""

from __future__ import annotations

from prefect import task

from integrations.protocols import Message
from tasks.runtime import current
from tasks.stage import stage


@task(name="notify", retries=3, retry_delay_seconds=[1, 2, 4], timeout_seconds=120)
def notify(message: Message) -> str:
    rt = current()
    with stage(rt.store, message.incident, "notify") as log:
        thread = rt.backends.notifier.post(message)
        log.done(f"posted to {message.channel} (thread {thread})", thread=thread)
        return thread


@task(name="update", retries=3, retry_delay_seconds=[1, 2, 4], timeout_seconds=120)
def update(incident_id: str, thread: str, text: str) -> None:
    rt = current()
    with stage(rt.store, incident_id, "update") as log:
        rt.backends.notifier.reply(thread, text)
        log.done(text)
