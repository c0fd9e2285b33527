"""Builders for what most tests feed the system: fault events (as models, wire dicts or JSON lines)
and incidents. One place knows how to make a valid event, so a test names only what matters to it.

    fault_event()                                   # xid 79 on gpu-017 at T0, a fresh id
    fault_event("nan_loss", id="a", minutes=5, job="48213", rank=0)
    fault_event("dcgm_health", node="n1", gpu=0, error_id=52)   # extra keywords are attributes
    fault_event("ecc", attributes={"dbe": 2})       # `attributes=` replaces the kind's defaults
    event_dict(id="e1", gpu=-1)                     # not validated: for the ingest/rejection tests
    event_line("nccl_timeout", seconds=30)          # one JSON line
    incident(fault_event(id="x1"), id="inc-x")      # these events as they are, no correlation

Times are `at` (default T0) plus `minutes` and `seconds`. Wall-clock tests pass
`at=datetime.now(UTC)`. (tests/fake_time.py is the monotonic clock for sleep/backoff tests; event
times are absolute, so they start from T0 here.)
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from medic.events import FaultEvent, event_time
from medic.incidents import Incident

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)  # the time of docs/events.md's examples
NODE = "gpu-017"
SOURCE = "test"

# Just the required attributes of each kind (docs/events.md's examples), so a test that names
# them all gets exactly what it named. Kinds not listed need none.
DEFAULT_ATTRIBUTES: dict[str, dict[str, Any]] = {
    "xid": {"code": 79},
    "dcgm_health": {"error_id": "DCGM_FR_VOLATILE_DBE_DETECTED"},
    "straggler": {"step_time_ratio": 1.8},
    "gpu_missing": {"expected": 8, "found": 7},
    "job_crash": {"exit_code": 137},
    "diagnostic": {"level": 3, "result": "fail"},
    "remediation": {"action": "drain"},
    "node_state": {"change": "drain"},
}

_ids = itertools.count(1)


def next_id(prefix: str = "ev") -> str:
    """A fresh id; zero-padded, so ids sort in the order they were made."""
    return f"{prefix}-{next(_ids):06d}"


def event_fields(
    kind: str = "xid",
    *,
    id: str | None = None,
    node: str = NODE,
    at: datetime | str | None = None,
    minutes: float = 0,
    seconds: float = 0,
    source: str = SOURCE,
    gpu: int | None = None,
    job: str | None = None,
    rank: int | None = None,
    iteration: int | None = None,
    switch: str | None = None,
    attributes: Mapping[str, Any] | None = None,
    **more_attributes: Any,
) -> dict[str, Any]:
    """The fields of one event, not validated; optional envelope fields left as None are left out.

    `time` is `at` (default T0) plus `minutes` and `seconds`; an `at` string is kept as written.
    `attributes` default to the kind's DEFAULT_ATTRIBUTES; keywords not named here are added to them.
    """
    if isinstance(at, str):
        if minutes or seconds:
            raise ValueError("an `at` string is sent as written: give no minutes or seconds with it")
        time: datetime | str = at
    else:
        time = (T0 if at is None else at) + timedelta(minutes=minutes, seconds=seconds)
    envelope = {"gpu": gpu, "job": job, "rank": rank, "iteration": iteration, "switch": switch}
    base = DEFAULT_ATTRIBUTES.get(kind, {}) if attributes is None else attributes
    return {
        "id": next_id() if id is None else id,
        "time": time,
        "source": source,
        "kind": kind,
        "node": node,
        **{name: value for name, value in envelope.items() if value is not None},
        "attributes": {**base, **more_attributes},
    }


def fault_event(kind: str = "xid", **fields: Any) -> FaultEvent:
    """A validated FaultEvent; takes what `event_fields` takes."""
    return FaultEvent(**event_fields(kind, **fields))


def event_dict(kind: str = "xid", **fields: Any) -> dict[str, Any]:
    """An event as a client sends it (JSON types, RFC 3339 time with `Z`), not validated.

    Takes what `event_fields` takes; for a top-level key it does not know, `event_dict(...) | {...}`.
    """
    data = event_fields(kind, **fields)
    if isinstance(data["time"], datetime):
        data["time"] = event_time(data["time"])
    return data


def event_line(kind: str = "xid", **fields: Any) -> str:
    """`event_dict` as one JSON line (no newline)."""
    return json.dumps(event_dict(kind, **fields))


def incident(*events: FaultEvent, id: str | None = None, node: str | None = None, **fields: Any) -> Incident:
    """An incident holding exactly these events, in this order (possibly on several nodes).

    The id defaults to `inc-<first event's id>`, the node to the first event's; `fields` are
    Incident's others (history, scope).
    """
    if id is None or node is None:
        first = events[0]
        id, node = id or f"inc-{first.id}", node or first.node
    return Incident(id=id, node=node, events=list(events), **fields)
