"""A `Notifier` for a deployment without Slack (MEDIC_NOTIFIER=console): every message and reply
goes to standard error, one block per message, and is kept in memory like the simulated one's."""

from __future__ import annotations

import sys
from typing import TextIO

from medic.integrations.sim.notifier import RecordingNotifier
from medic.protocols import Message


class ConsoleNotifier(RecordingNotifier):
    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__()
        self._stream = stream

    def _write(self, text: str) -> None:
        stream = self._stream or sys.stderr
        stream.write(text + "\n")
        stream.flush()

    def post(self, message: Message) -> str:
        ref = super().post(message)
        files = "".join(f"\n{a.what}: {a.path}" for a in message.artifacts)
        self._write(f"[medic {ref}] {message.channel}: {message.title}\n{message.body}{files}")
        return ref

    def reply(self, thread: str, text: str) -> None:
        super().reply(thread, text)
        self._write(f"[medic {thread}] {text}")
