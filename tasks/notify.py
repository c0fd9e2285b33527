"""Notify: one message per incident, then its story in the thread as the flow moves.

A chat outage never fails remediation: these tasks retry with backoff, and `IncidentThread`, the
flow's handle on them, records a final failure and goes on.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.states import State

from medic.protocols import Message
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


class IncidentThread:
    """The incident's chat thread: one head message, then one reply per step. Never raises.

    The head goes out when something first needs the thread, not at the start: on the plain
    path that is after the node action, so a slow chat API never delays taking a bad node out.
    """

    def __init__(self, incident_id: str, head: Message) -> None:
        self.incident_id, self.head = incident_id, head
        self.ref: str | None = None
        self.opened = False
        self.ok = True

    async def open(self) -> None:
        if self.opened:
            return
        self.opened = True
        state: State[str] = notify(self.head, return_state=True)
        if state.is_completed():
            self.ref = await state.result()
            return
        self.ok = False
        get_run_logger().error("notification failed, remediation goes on: %s", state.message)

    async def say(self, text: str) -> None:
        await self.open()
        if self.ref is None:
            return
        if not update(self.incident_id, self.ref, text, return_state=True).is_completed():
            self.ok = False
            get_run_logger().error("thread update failed, remediation goes on")
