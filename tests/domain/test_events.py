"""The public event schema (medic/events.py) and its documentation (docs/events.md)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from checkout import REPO_ROOT
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from medic.events import (
    ATTRIBUTE_MODELS,
    MAX_ATTRIBUTE_DEPTH,
    DiagnosticAttributes,
    EventKind,
    FaultEvent,
    GpuMissingAttributes,
    XidAttributes,
    describe_validation_error,
    event_time,
    first_problem,
    value_problem,
)

DOCS = REPO_ROOT / "docs" / "events.md"

ENVELOPE = [
    "id",
    "time",
    "source",
    "kind",
    "node",
    "gpu",
    "job",
    "rank",
    "iteration",
    "switch",
    "attributes",
]
REQUIRED = ["id", "time", "source", "kind", "node"]


def payload(kind: str = "xid", attributes: dict[str, Any] | None = None, **envelope: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": "ev-1",
        "time": "2025-03-01T12:00:00Z",
        "source": "agent",
        "kind": kind,
        "node": "gpu-017",
        "attributes": {"code": 79} if attributes is None and kind == "xid" else (attributes or {}),
    }
    data.update(envelope)
    return data


def reason(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        FaultEvent.model_validate(data)
    return describe_validation_error(caught.value)


GOOD: dict[EventKind, dict[str, Any]] = {
    EventKind.XID: {"code": 79, "message": "GPU has fallen off the bus"},
    EventKind.DCGM_HEALTH: {"error_id": "DCGM_FR_VOLATILE_DBE_DETECTED"},
    EventKind.ECC: {"dbe": 1, "sbe": 12},
    EventKind.NCCL_TIMEOUT: {},
    EventKind.NAN_LOSS: {},
    EventKind.STRAGGLER: {"step_time_ratio": 1.8},
    EventKind.THERMAL: {"temperature_c": 91.5, "throttle_reasons": ["hw_thermal_slowdown"]},
    EventKind.GPU_MISSING: {"expected": 8, "found": 7},
    EventKind.NODE_UNREACHABLE: {},
    EventKind.JOB_CRASH: {"exit_code": 137},
    EventKind.HEALTH_CHECK: {"phase": "prolog", "check": "nvidia-smi", "message": "7 of 8 visible"},
    EventKind.DIAGNOSTIC: {"level": 3, "result": "fail", "error_ids": ["DCGM_FR_VOLATILE_DBE_DETECTED", 4]},
    EventKind.REMEDIATION: {"action": "drain"},
    EventKind.NODE_STATE: {"change": "drain", "reason": "admin: bad fan", "reason_set_by": "root"},
}

# (kind, attributes, the field the reason must name, a fragment of the message)
BAD = [
    ("xid", {}, "attributes.code", "Field required"),
    ("xid", {"message": "no code"}, "attributes.code", "Field required"),
    ("xid", {"code": 0}, "attributes.code", "greater than or equal to 1"),
    ("xid", {"code": 1001}, "attributes.code", "less than or equal to 1000"),
    ("xid", {"code": "seventy-nine"}, "attributes.code", "integer"),
    ("dcgm_health", {}, "attributes.error_id", "Field required"),
    ("dcgm_health", {"error_id": [4]}, "attributes.error_id.int", "valid integer"),
    ("ecc", {"dbe": -1}, "attributes.dbe", "greater than or equal to 0"),
    ("ecc", {"sbe": "many"}, "attributes.sbe", "integer"),
    ("straggler", {}, "attributes.step_time_ratio", "Field required"),
    ("straggler", {"step_time_ratio": 0}, "attributes.step_time_ratio", "greater than 0"),
    ("straggler", {"step_time_ratio": -1.5}, "attributes.step_time_ratio", "greater than 0"),
    ("thermal", {"throttle_reasons": "hot"}, "attributes.throttle_reasons", "list"),
    ("thermal", {"temperature_c": "warm"}, "attributes.temperature_c", "number"),
    ("gpu_missing", {"expected": 8, "found": 8}, "attributes", "found (8) must be less than expected (8)"),
    ("gpu_missing", {"expected": 8, "found": 9}, "attributes", "found (9) must be less than expected (8)"),
    ("gpu_missing", {"expected": 8}, "attributes.found", "Field required"),
    ("gpu_missing", {"expected": 8, "found": -1}, "attributes.found", "greater than or equal to 0"),
    ("job_crash", {}, "attributes.exit_code", "Field required"),
    ("health_check", {"phase": "preflight"}, "attributes.phase", "'prolog', 'epilog' or 'healthcheck'"),
    ("diagnostic", {"level": 5, "result": "fail"}, "attributes.level", "less than or equal to 4"),
    ("diagnostic", {"level": 0, "result": "pass"}, "attributes.level", "greater than or equal to 1"),
    ("diagnostic", {"result": "pass"}, "attributes.level", "Field required"),
    ("diagnostic", {"level": 2, "result": "maybe"}, "attributes.result", "'pass' or 'fail'"),
    ("diagnostic", {"level": 2}, "attributes.result", "Field required"),
    ("remediation", {}, "attributes.action", "Field required"),
    ("node_state", {}, "attributes.change", "Field required"),
    ("node_state", {"change": "maintenance"}, "attributes.change", "'drain', 'fail', 'down'"),
    ("node_state", {"change": "drain", "reason_set_at": "yesterday"}, "attributes.reason_set_at", "datetime"),
]


def test_every_kind_has_a_good_example() -> None:
    assert set(GOOD) == set(EventKind)
    assert set(ATTRIBUTE_MODELS) == set(EventKind)


@pytest.mark.parametrize("kind", list(EventKind), ids=str)
def test_each_kind_validates_with_good_attributes(kind: EventKind) -> None:
    event = FaultEvent.model_validate(payload(kind.value, GOOD[kind]))
    assert event.kind is kind
    assert event.attributes == GOOD[kind]
    typed = event.typed_attributes()
    assert isinstance(typed, ATTRIBUTE_MODELS[kind])
    for name, value in GOOD[kind].items():
        assert getattr(typed, name) == value


@pytest.mark.parametrize(("kind", "attributes", "field", "fragment"), BAD)
def test_bad_attributes_are_rejected_naming_the_field(
    kind: str, attributes: dict[str, Any], field: str, fragment: str
) -> None:
    message = reason(payload(kind, attributes))
    assert message.startswith(f"{field}: "), message
    assert fragment in message


def test_dcgm_error_id_may_be_a_number() -> None:
    event = FaultEvent.model_validate(payload("dcgm_health", {"error_id": 4}))
    assert event.typed_attributes().error_id == 4


def test_ecc_counts_default_to_zero() -> None:
    typed = FaultEvent.model_validate(payload("ecc", {})).typed_attributes()
    assert (typed.dbe, typed.sbe) == (0, 0)


def test_health_check_phase_defaults_to_healthcheck() -> None:
    typed = FaultEvent.model_validate(payload("health_check", {})).typed_attributes()
    assert typed.phase == "healthcheck"


def test_straggler_ratio_must_be_finite() -> None:
    # An infinite ratio would be written back as null and then rejected on replay.
    event = {**payload("straggler"), "attributes": {"step_time_ratio": float("inf")}}
    assert reason(event).startswith("attributes.step_time_ratio: ")


def test_gpu_missing_accepts_zero_found() -> None:
    typed = FaultEvent.model_validate(payload("gpu_missing", {"expected": 8, "found": 0})).typed_attributes()
    assert isinstance(typed, GpuMissingAttributes)
    assert typed.found == 0


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_diagnostic_levels_one_to_four(level: int) -> None:
    typed = FaultEvent.model_validate(payload("diagnostic", {"level": level, "result": "pass"}))
    assert isinstance(typed.typed_attributes(), DiagnosticAttributes)


def test_unknown_attributes_are_kept() -> None:
    attributes = {"code": 48, "pci_bus_id": "0000:3b:00.0", "raw": {"line": "NVRM: Xid 48"}}
    event = FaultEvent.model_validate(payload("xid", attributes))
    assert event.attributes == attributes
    typed = event.typed_attributes()
    assert isinstance(typed, XidAttributes)
    assert typed.code == 48


@pytest.mark.parametrize("kind", ["nccl_timeout", "nan_loss", "node_unreachable"])
def test_kinds_without_attributes_accept_extras_but_need_an_object(kind: str) -> None:
    assert FaultEvent.model_validate(payload(kind, {"note": "x"})).attributes == {"note": "x"}
    assert reason({**payload(kind), "attributes": []}).startswith("attributes: ")


def test_attributes_may_not_nest_too_deep() -> None:
    nested: Any = 1
    for _ in range(MAX_ATTRIBUTE_DEPTH):  # the attributes object itself is level 0
        nested = [nested]
    deepest = FaultEvent.model_validate(payload("nan_loss", {"x": nested}))
    assert FaultEvent.model_validate_json(deepest.model_dump_json()) == deepest  # still writable
    message = reason(payload("nan_loss", {"x": [nested]}))
    assert message == f"attributes: nested deeper than {MAX_ATTRIBUTE_DEPTH} levels"


# --- the envelope -------------------------------------------------------------------------


def test_minimal_event_and_defaults() -> None:
    event = FaultEvent.model_validate(payload("nan_loss", None))
    assert event.id == "ev-1"
    assert event.node == "gpu-017"
    assert event.source == "agent"
    assert event.time == datetime(2025, 3, 1, 12, tzinfo=UTC)
    assert (event.gpu, event.job, event.rank, event.iteration, event.switch) == (None,) * 5
    assert event.attributes == {}


def test_optional_envelope_fields() -> None:
    event = FaultEvent.model_validate(
        payload(
            "straggler", {"step_time_ratio": 2.0}, gpu=3, job="48213", rank=24, iteration=900, switch="l4"
        )
    )
    assert (event.gpu, event.job, event.rank, event.iteration, event.switch) == (3, "48213", 24, 900, "l4")


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field_is_named(field: str) -> None:
    data = payload()
    del data[field]
    assert reason(data) == f"{field}: Field required"


@pytest.mark.parametrize("time", ["2025-03-01T12:00:00", "2025-03-01 12:00:00", "2025-03-01T12:00:00.5"])
def test_time_without_offset_is_rejected(time: str) -> None:
    assert reason(payload(time=time)).startswith("time: ")


@pytest.mark.parametrize("time", ["yesterday", "2025-13-01T00:00:00Z", ""])
def test_time_that_is_not_a_time_is_rejected(time: str) -> None:
    assert reason(payload(time=time)).startswith("time: ")


@pytest.mark.parametrize(
    ("time", "why"),
    [
        ("0001-01-01T00:00:00+01:00", "its UTC time is not representable"),
        ("9999-12-31T23:59:59-01:00", "its UTC time is not representable"),
        ("0001-01-01T00:00:00Z", "must be from 1970-01-01T00:00:00Z to before 2100-01-01T00:00:00Z"),
        ("1969-12-31T23:59:59Z", "must be from 1970-01-01T00:00:00Z"),
        ("1970-01-01T00:30:00+01:00", "must be from 1970-01-01T00:00:00Z"),  # 1969 in UTC
        ("2100-01-01T00:00:00Z", "to before 2100-01-01T00:00:00Z"),
        ("9999-12-31T23:59:59Z", "to before 2100-01-01T00:00:00Z"),
    ],
)
def test_time_out_of_range_is_rejected_with_a_reason(time: str, why: str) -> None:
    message = reason(payload(time=time))
    assert message.startswith("time: ") and "is out of range" in message and why in message


@pytest.mark.parametrize(
    "time", ["1970-01-01T00:00:00Z", "1970-01-01T01:00:00+01:00", "2099-12-31T23:59:59Z"]
)
def test_time_range_edges_are_accepted(time: str) -> None:
    assert FaultEvent.model_validate(payload(time=time)).time.year in (1970, 2099)


@pytest.mark.parametrize("field", ["gpu", "rank", "iteration"])
@pytest.mark.parametrize("value", [2**63, str(2**63), 10**30])
def test_envelope_integers_must_fit_in_64_bits(field: str, value: Any) -> None:
    assert reason(payload(**{field: value})) == (
        f"{field}: integer out of range: must fit in signed 64 bits (-2**63 to 2**63-1)"
    )
    assert getattr(FaultEvent.model_validate(payload(**{field: 2**63 - 1})), field) == 2**63 - 1


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"code": 79, "pci": 2**63}, "attributes.pci: integer out of range"),
        ({"code": 79, "pci": [1, -(2**63) - 1]}, "attributes.pci.1: integer out of range"),
        (
            {"code": 79, "pci": {"bus": float("inf")}},
            "attributes.pci.bus: number out of range: must be finite",
        ),
        (
            {"code": 79, "message": "bad \ud800"},
            "attributes.message: not valid UTF-8 (contains a lone surrogate)",
        ),
        ({"code": 79, "\udc80": 1}, "attributes key: not valid UTF-8 (contains a lone surrogate)"),
        ({"code": 79, "k" * 201: 1}, "attributes: a key is longer than 200 characters"),
        ({"code": 79, "x": list(range(1000))}, "attributes: more than 1000 keys and items"),
        ({"code": 79, "x": "y" * (64 * 1024)}, "attributes: larger than 65536 bytes as JSON"),
    ],
)
def test_attribute_values_the_store_cannot_hold_are_rejected(
    attributes: dict[str, Any], message: str
) -> None:
    assert reason(payload("xid", attributes)).startswith(message)


def test_ecc_count_coerced_from_a_string_is_checked_after_coercion() -> None:
    assert reason(payload("ecc", {"dbe": str(2**64)})) == (
        "attributes.dbe: integer out of range: must fit in signed 64 bits (-2**63 to 2**63-1)"
    )


def test_lone_surrogate_in_an_envelope_string_is_named() -> None:
    assert reason(payload(node="gpu-\ud800")) == "node: not valid UTF-8 (contains a lone surrogate)"


def test_time_with_offset_is_the_same_instant() -> None:
    utc = FaultEvent.model_validate(payload(time="2025-03-01T12:00:00Z"))
    plus_one = FaultEvent.model_validate(payload(time="2025-03-01T13:00:00+01:00"))
    assert utc.time == plus_one.time
    assert plus_one.time.utcoffset() == timedelta(hours=1)


def test_unknown_kind_is_rejected() -> None:
    message = reason(payload("gpu_on_fire"))
    assert message.startswith("kind: ")
    for kind in EventKind:
        assert f"'{kind.value}'" in message


def test_unknown_top_level_key_is_rejected() -> None:
    assert reason(payload(colour="red")) == "colour: Extra inputs are not permitted"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("id", ""),
        ("id", "x" * 201),
        ("node", ""),
        ("source", ""),
        ("gpu", -1),
        ("rank", -1),
        ("iteration", -1),
        ("gpu", "three"),
        ("job", "j" * 201),
        ("switch", "s" * 201),
        ("attributes", None),
        ("attributes", "code=79"),
    ],
)
def test_bad_envelope_values_name_the_field(field: str, value: Any) -> None:
    assert reason({**payload(), field: value}).startswith(f"{field}: ")


def test_several_failures_are_all_named() -> None:
    message = reason(payload(gpu=-1, colour="red", time="2025-03-01T12:00:00"))
    parts = message.split("; ")
    assert sorted(p.split(":")[0] for p in parts) == ["colour", "gpu", "time"]


def test_attribute_errors_are_not_reported_when_the_kind_is_bad() -> None:
    assert reason(payload("nope", {"code": "x"})).startswith("kind: ")


def test_events_are_immutable() -> None:
    event = FaultEvent.model_validate(payload())
    with pytest.raises(ValidationError):
        event.node = "other"  # type: ignore[misc]


def test_json_round_trip() -> None:
    event = FaultEvent.model_validate(payload(time="2025-03-01T13:00:00+01:00", gpu=0, job="7"))
    again = FaultEvent.model_validate_json(event.model_dump_json())
    assert again == event


def test_event_time_is_rfc3339_utc_with_z() -> None:
    assert event_time(datetime(2025, 3, 1, 12, 30, tzinfo=UTC)) == "2025-03-01T12:30:00Z"
    moved = datetime(2025, 3, 1, 13, tzinfo=timezone(timedelta(hours=1)))
    assert event_time(moved) == "2025-03-01T13:00:00+01:00"
    assert FaultEvent.model_validate(payload(time=event_time(datetime(2025, 1, 1, tzinfo=UTC))))


# --- the contract: JSON Schema and docs ---------------------------------------------------


def test_json_schema_has_exactly_the_documented_properties() -> None:
    schema = FaultEvent.model_json_schema()
    assert list(schema["properties"]) == ENVELOPE
    assert sorted(schema["required"]) == sorted(REQUIRED)
    assert schema["additionalProperties"] is False
    kind = schema["$defs"]["EventKind"]
    assert kind["enum"] == [k.value for k in EventKind]
    assert schema["properties"]["time"]["format"] == "date-time"


def test_event_kinds_are_the_documented_ones() -> None:
    assert [k.value for k in EventKind] == [
        "xid",
        "dcgm_health",
        "ecc",
        "nccl_timeout",
        "nan_loss",
        "straggler",
        "thermal",
        "gpu_missing",
        "node_unreachable",
        "job_crash",
        "health_check",
        "diagnostic",
        "remediation",
        "node_state",
    ]


def _doc() -> str:
    return DOCS.read_text(encoding="utf-8")


def test_docs_list_every_envelope_field() -> None:
    rows = [line for line in _doc().splitlines() if line.startswith("| `")]
    for name in ENVELOPE:
        assert any(row.startswith(f"| `{name}` ") for row in rows), name


@pytest.mark.parametrize("kind", list(EventKind), ids=str)
def test_docs_table_lists_every_attribute_of_each_kind(kind: EventKind) -> None:
    rows = [line for line in _doc().splitlines() if line.startswith(f"| `{kind.value}` |")]
    assert len(rows) == 1, f"one table row for {kind.value}"
    fields = ATTRIBUTE_MODELS[kind].model_fields
    for name in fields:
        assert f"`{name}`" in rows[0], f"{kind.value}.{name} missing from docs"
    if not fields:
        assert rows[0].rstrip(" |").endswith("none")
    for name, info in fields.items():
        assert ("required" in _described(rows[0], name)) == info.is_required(), name


def _described(row: str, name: str) -> str:
    """The parenthesised text after `name` in a table row."""
    rest = row.split(f"`{name}` (", 1)[1]
    depth = 1
    for index, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[:index]
    raise AssertionError(f"unbalanced description of {name}")


def test_docs_examples_are_valid_and_cover_every_kind() -> None:
    examples = [line for line in _doc().splitlines() if line.startswith('{"id"')]
    events = [FaultEvent.model_validate(json.loads(line)) for line in examples]
    assert [e.kind for e in events] == list(EventKind)
    assert len({e.id for e in events}) == len(events)


# --- value_problem's quick walk says "wrong" exactly when the full walk names a problem ----------

_SCALARS = st.one_of(
    st.text(st.characters(codec=None, categories=None), max_size=8),  # lone surrogates included
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
)
# Around the key and item limits only the length matters: built from a drawn length, not drawn one
# character or item at a time (a thousand draws each made this the suite's slowest unit test).
_LONG_KEYS = st.builds(lambda n, c: c * n, st.integers(195, 205), st.characters(codec=None, categories=None))
_KEYS = st.one_of(st.text(max_size=8), _LONG_KEYS, st.just("attributes"))
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(_KEYS, inner, max_size=6),
        st.builds(lambda n, item: [item] * n, st.integers(995, 1005), st.integers(0, 9)),
    ),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(value=_VALUES, path=st.sampled_from(["", "attributes", "attributes.k", "node"]))
@example(value={"k" * 201: 1}, path="attributes")  # one past each limit, which draws rarely hit
@example(value={"k": [0] * 1001}, path="attributes")
def test_the_quick_check_agrees_with_the_full_one(value: Any, path: str) -> None:
    assert value_problem(value, path) == first_problem(value, path)
