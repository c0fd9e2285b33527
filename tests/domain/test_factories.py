"""The test factories themselves (tests/factories.py): what other tests take for granted."""

from __future__ import annotations

import json

import pytest
from factories import T0, event_dict, event_line, fault_event, incident

from medic.events import EventKind, FaultEvent


@pytest.mark.parametrize("kind", list(EventKind))
def test_every_kind_is_valid_with_no_arguments(kind: EventKind) -> None:
    event = fault_event(kind)
    assert (event.kind, event.node, event.time, event.source) == (kind, "gpu-017", T0, "test")
    assert FaultEvent.model_validate(event_dict(kind)).kind == kind


def test_naming_every_required_attribute_gives_exactly_those() -> None:
    assert fault_event(code=13).attributes == {"code": 13}
    assert fault_event("diagnostic", level=1, result="pass").attributes == {
        "level": 1,
        "result": "pass",
        "error_ids": [],
    }
    assert fault_event("ecc", attributes={"dbe": 2}).attributes == {"dbe": 2, "sbe": 0}


def test_fresh_ids_are_unique_and_sort_in_the_order_made() -> None:
    ids = [fault_event().id for _ in range(12)]
    assert ids == sorted(ids) and len(set(ids)) == 12


def test_the_wire_forms_match_the_model() -> None:
    event = fault_event("nan_loss", id="a", minutes=1, seconds=30, job="7", rank=0)
    sent = event_dict("nan_loss", id="a", minutes=1, seconds=30, job="7", rank=0)
    assert sent == event.model_dump(mode="json", exclude_none=True)
    assert sent["time"] == "2025-03-01T12:01:30Z"
    assert json.loads(event_line("nan_loss", id="a", minutes=1, seconds=30, job="7", rank=0)) == sent
    # Not validated: a test can send what the schema refuses.
    assert event_dict(id="bad", gpu=-1, attributes={})["gpu"] == -1


def test_incident_defaults_to_its_first_event() -> None:
    first, second = fault_event(id="x1"), fault_event(id="x2", node="gpu-002")
    built = incident(first, second)
    assert (built.id, built.node, built.events) == ("inc-x1", "gpu-017", [first, second])
    assert incident(id="inc-empty", node="n").events == []
