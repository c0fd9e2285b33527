"""Notify: tell the owner what happened and what to do. A failure here never fails remediation."""

from __future__ import annotations

from prefect import task

from integrations.protocols import Message
from tasks.runtime import current
from tasks.stage import stage


@task(name="notify", retries=3, retry_delay_seconds=[1, 2, 4], timeout_seconds=60)
def notify(message: Message, updates: list[str]) -> str:
    rt = current()
    with stage(rt.store, message.incident, "notify") as log:
        thread = rt.backends.notifier.post(message)
        for text in updates:
            rt.backends.notifier.reply(thread, text)
        log.done(f"posted to {message.channel} ({len(updates)} updates in thread {thread})", thread=thread)
        return thread
