"""A `Notifier` that keeps messages in memory; the demo prints them as Slack would show them."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from medic.protocols import Message


@dataclass(slots=True)
class Thread:
    ref: str
    message: Message
    replies: list[str] = field(default_factory=list)


class RecordingNotifier:
    def __init__(self) -> None:
        self.threads: dict[str, Thread] = {}
        self._lock = threading.Lock()

    def post(self, message: Message) -> str:
        with self._lock:
            ref = f"sim-{len(self.threads) + 1}"
            self.threads[ref] = Thread(ref, message)
            return ref

    def reply(self, thread: str, text: str) -> None:
        with self._lock:
            self.threads[thread].replies.append(text)
