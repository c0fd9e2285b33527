"""`medic triage`: events in, one decision per incident out, nothing acted on. No Prefect needed.

One job a module: the decisions' JSON form (`line`, a public contract), the file reader (`reader`) and
its id set (`ids`), the stream's context (`recent`, a `medic.context.Window`), the fleet a replay's
decisions leave (`fleet`) and each group's limits over it (`limits`), and the engine (`stream`).
"""

from medic.triage.line import TriageLine, triage_line
from medic.triage.reader import EventReader, read_file
from medic.triage.stream import OutOfOrder, Replayed, Stream, replay, stream, triage

__all__ = [
    "EventReader",
    "OutOfOrder",
    "Replayed",
    "Stream",
    "TriageLine",
    "read_file",
    "replay",
    "stream",
    "triage",
    "triage_line",
]
