"""The public fault-event schema (documented in docs/events.md).

One JSON object per event. The envelope is the same for every kind; `attributes` carries
what is specific to a kind and is validated per kind, so a typo in an XID code is caught
at the door instead of deep inside a policy rule.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    ValidationError,
    model_validator,
)

SCHEMA_VERSION = 1
MAX_ATTRIBUTE_DEPTH = 32  # well below pydantic's serialization limit, so every accepted event can be written

# The limits of docs/events.md#limits: what every store we write to can hold, checked at the door
# so that a bad value is a rejection with a reason instead of an exception (or a lost batch) later.
MIN_TIME = datetime(1970, 1, 1, tzinfo=UTC)  # inclusive
MAX_TIME = datetime(2100, 1, 1, tzinfo=UTC)  # exclusive: fixed, so a replay decides as the first read did
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # SQLite INTEGER, PostgreSQL BIGINT
MAX_ATTRIBUTE_ITEMS = 1000  # keys and list items, counted at every level
MAX_ATTRIBUTE_KEY_LENGTH = 200
MAX_ATTRIBUTES_BYTES = 64 * 1024  # as JSON: the most a line can carry


def _sane_time(value: datetime) -> datetime:
    try:
        utc = value.astimezone(UTC)
    except (OverflowError, ValueError):
        raise ValueError(f"{value.isoformat()} is out of range: its UTC time is not representable") from None
    if not MIN_TIME <= utc < MAX_TIME:
        raise ValueError(
            f"{value.isoformat()} is out of range: must be from {event_time(MIN_TIME)} to before "
            f"{event_time(MAX_TIME)}"
        )
    return value


def _int64(value: int) -> int:
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(_INT64_MESSAGE)
    return value


_INT64_MESSAGE = "integer out of range: must fit in signed 64 bits (-2**63 to 2**63-1)"

# `json.dumps` with options builds an encoder per call; this one is built once.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))

EventTime = Annotated[AwareDatetime, AfterValidator(_sane_time)]
Count = Annotated[NonNegativeInt, AfterValidator(_int64)]


class EventKind(StrEnum):
    XID = "xid"
    DCGM_HEALTH = "dcgm_health"
    ECC = "ecc"
    NCCL_TIMEOUT = "nccl_timeout"
    NAN_LOSS = "nan_loss"
    STRAGGLER = "straggler"
    THERMAL = "thermal"
    GPU_MISSING = "gpu_missing"
    NODE_UNREACHABLE = "node_unreachable"
    JOB_CRASH = "job_crash"
    HEALTH_CHECK = "health_check"
    DIAGNOSTIC = "diagnostic"
    REMEDIATION = "remediation"
    # A change of a node's state in the scheduler that GPU Medic did not make: what people (or the
    # scheduler itself) did, evidence for the rollout report, never trouble. It opens no incident and
    # moves nothing (docs/decisions/0019-human-actions-as-events.md).
    NODE_STATE = "node_state"


# What changed, in the scheduler's words made common: its DRAIN and FAIL flags set, its base state DOWN,
# NOT_RESPONDING set, the DRAIN/FAIL/DOWN cleared, a reboot asked for, a new BootTime.
NodeStateChange = Literal["drain", "fail", "down", "not_responding", "resume", "reboot_requested", "reboot"]


class _Attributes(BaseModel):
    # Sources add their own context (PCI bus id, message text, ...): keep it, don't reject it.
    model_config = ConfigDict(extra="allow", frozen=True)


class XidAttributes(_Attributes):
    code: int = Field(ge=1, le=1000, description="The XID number from the NVRM kernel message.")
    message: str | None = None


class DcgmHealthAttributes(_Attributes):
    error_id: int | str = Field(description="A DCGM_FR_* error: its name or its numeric id.")
    message: str | None = None


class EccAttributes(_Attributes):
    dbe: NonNegativeInt = 0
    sbe: NonNegativeInt = 0


class StragglerAttributes(_Attributes):
    step_time_ratio: float = Field(
        gt=0, allow_inf_nan=False, description="This rank's step time over the job's median."
    )


class ThermalAttributes(_Attributes):
    temperature_c: float | None = None
    throttle_reasons: list[str] = Field(default_factory=list)


class GpuMissingAttributes(_Attributes):
    expected: NonNegativeInt
    found: NonNegativeInt

    @model_validator(mode="after")
    def _fewer_found(self) -> GpuMissingAttributes:
        if self.found >= self.expected:
            raise ValueError(f"found ({self.found}) must be less than expected ({self.expected})")
        return self


class JobCrashAttributes(_Attributes):
    exit_code: int


class HealthCheckAttributes(_Attributes):
    phase: Literal["prolog", "epilog", "healthcheck"] = "healthcheck"
    check: str | None = None
    message: str | None = None


class DiagnosticAttributes(_Attributes):
    level: int = Field(ge=1, le=4)
    result: Literal["pass", "fail"]
    error_ids: list[int | str] = Field(default_factory=list)


class RemediationAttributes(_Attributes):
    action: str


class NodeStateAttributes(_Attributes):
    change: NodeStateChange
    state: str | None = None
    previous: str | None = None
    reason: str | None = None
    reason_set_by: str | None = None
    reason_set_at: EventTime | None = None
    seen_at: EventTime | None = None


class EmptyAttributes(_Attributes):
    pass


ATTRIBUTE_MODELS: dict[EventKind, type[_Attributes]] = {
    EventKind.XID: XidAttributes,
    EventKind.DCGM_HEALTH: DcgmHealthAttributes,
    EventKind.ECC: EccAttributes,
    EventKind.NCCL_TIMEOUT: EmptyAttributes,
    EventKind.NAN_LOSS: EmptyAttributes,
    EventKind.STRAGGLER: StragglerAttributes,
    EventKind.THERMAL: ThermalAttributes,
    EventKind.GPU_MISSING: GpuMissingAttributes,
    EventKind.NODE_UNREACHABLE: EmptyAttributes,
    EventKind.JOB_CRASH: JobCrashAttributes,
    EventKind.HEALTH_CHECK: HealthCheckAttributes,
    EventKind.DIAGNOSTIC: DiagnosticAttributes,
    EventKind.REMEDIATION: RemediationAttributes,
    EventKind.NODE_STATE: NodeStateAttributes,
}


class FaultEvent(BaseModel):
    """One fault signal from one source about one node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200, description="Unique; a repeated id is ignored.")
    time: EventTime = Field(description="When the fault happened (RFC 3339 with a UTC offset).")
    source: str = Field(min_length=1, max_length=200, description="Who saw it: agent, dcgm, slurm, job...")
    kind: EventKind
    node: str = Field(min_length=1, max_length=200)
    gpu: Count | None = None
    job: str | None = Field(default=None, max_length=200)
    rank: Count | None = None
    iteration: Count | None = None
    switch: str | None = Field(default=None, max_length=200, description="Leaf switch or rack.")
    attributes: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _check_values(cls, data: Any) -> Any:
        # Before pydantic sees them: a lone surrogate, an integer the store cannot hold or a
        # NaN anywhere in the document (keys included) is refused, naming where it is.
        if isinstance(data, dict):
            problem = value_problem(data)
            if problem:
                raise ValueError(problem)
        return data

    @model_validator(mode="after")
    def _check_attributes(self) -> FaultEvent:
        # Validate, then keep the normalised plain dict ("79" becomes 79): the envelope stays
        # JSON-shaped for the store, and rules compare like with like.
        if _too_deep(self.attributes, MAX_ATTRIBUTE_DEPTH):
            raise ValueError(f"attributes: nested deeper than {MAX_ATTRIBUTE_DEPTH} levels")
        try:
            typed = ATTRIBUTE_MODELS[self.kind].model_validate(self.attributes)
        except ValidationError as error:
            raise ValueError(describe_validation_error(error, prefix="attributes")) from None
        attributes = typed.model_dump(mode="json", exclude_none=True)
        # Again after coercion: "99999999999999999999" was a string and is now an integer.
        problem = value_problem(attributes, "attributes")
        if problem is None and len(_COMPACT.encode(attributes).encode()) > MAX_ATTRIBUTES_BYTES:
            problem = f"attributes: larger than {MAX_ATTRIBUTES_BYTES} bytes as JSON"
        if problem:
            raise ValueError(problem)
        fields = self.__dict__
        fields["attributes"] = attributes
        # A replay holds hundreds of thousands of events: the names of nodes, switches, jobs and
        # sources repeat, and so does the set of fields given, which pydantic keeps per instance
        # (the model is frozen, so nothing changes a shared one).
        for name in _REPEATED:
            value = fields[name]
            if value is not None:
                fields[name] = sys.intern(value)
        given = self.__pydantic_fields_set__
        object.__setattr__(self, "__pydantic_fields_set__", _FIELDS_GIVEN.setdefault(frozenset(given), given))
        return self

    def typed_attributes(self) -> _Attributes:
        return ATTRIBUTE_MODELS[self.kind].model_validate(self.attributes)


_REPEATED = ("source", "node", "job", "switch")
# At most one per subset of the envelope's optional fields.
_FIELDS_GIVEN: dict[frozenset[str], set[str]] = {}
_new_event = FaultEvent.__new__
_set = object.__setattr__  # frozen: set as pydantic sets it


def validated_event(fields: dict[str, Any], given: frozenset[str]) -> FaultEvent:
    """An event whose fields were validated before (read back from the store, or handed over by the
    process that read them), built as pydantic builds a copy: its fields set directly.

    `model_construct` would look up every field's aliases and defaults again, at three times the
    cost, for each of the hundreds of thousands of events a replay or a triage builds. The names that
    repeat are interned and the set of fields given is shared, as validation leaves them."""
    for name in _REPEATED:
        value = fields[name]
        if value is not None:
            fields[name] = sys.intern(value)
    event = _new_event(FaultEvent)
    _set(event, "__dict__", fields)
    shared = _FIELDS_GIVEN.get(given)
    if shared is None:
        shared = _FIELDS_GIVEN.setdefault(given, set(given))
    _set(event, "__pydantic_fields_set__", shared)
    _set(event, "__pydantic_extra__", None)
    _set(event, "__pydantic_private__", None)
    return event


def _too_deep(value: Any, limit: int) -> bool:
    """Whether dicts/lists inside `value` nest more than `limit` levels (iterative: no recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def value_problem(value: Any, path: str = "") -> str | None:
    """The first value inside `value` that no store can hold, as `where: why`; None if all is well.

    Strings must be valid UTF-8 (no lone surrogate, which JSON's `"\\ud800"` decodes to),
    integers must fit in signed 64 bits, numbers must be finite; `attributes` also has a limit on
    its keys and items. Iterative, so no input can exhaust the stack.
    """
    # Every event goes through here twice: a walk that only says whether anything is wrong is a
    # fraction of the cost of naming where, which only a bad value pays for.
    if not path:
        state = _ROOT
    elif path == "attributes" or path.startswith("attributes."):
        state = _IN_ATTRIBUTES
    else:
        state = _OUTSIDE
    return first_problem(value, path) if _any_problem(value, state) else None


# Where a container is, for `_any_problem`: as `first_problem` tells it from the path it builds.
_ROOT, _OUTSIDE, _IN_ATTRIBUTES = 0, 1, 2


def _any_problem(value: Any, state: int) -> bool:
    """Whether `first_problem` finds something: the same checks, with no path built."""
    items = 0
    stack: list[tuple[Any, int]] = [(value, state)]
    while stack:
        item, state = stack.pop()
        if isinstance(item, dict):
            pairs: Iterable[tuple[Any, Any]] = item.items()
        elif isinstance(item, list):
            pairs = enumerate(item)
        else:
            if _leaf_problem(item):
                return True
            continue
        inside = state == _IN_ATTRIBUTES
        if inside:
            items += len(item)
            if items > MAX_ATTRIBUTE_ITEMS:
                return True
        for key, child in pairs:
            if isinstance(key, str):
                if not key.isascii() and _has_surrogate(key):
                    return True
                if inside and len(key) > MAX_ATTRIBUTE_KEY_LENGTH:
                    return True
            kind = type(child)
            # The JSON types themselves first, inline: each event has a dozen of them.
            if kind is str:
                if not child.isascii() and _has_surrogate(child):
                    return True
            elif kind is int:
                if not INT64_MIN <= child <= INT64_MAX:
                    return True
            elif kind is dict or kind is list or isinstance(child, dict | list):
                stack.append((child, state or _child_state(key)))
            elif _leaf_problem(child):
                return True
    return False


def _child_state(key: Any) -> int:
    """Where a child of the root is: its path is its key (a string key cut to 40 characters)."""
    where = key[:40] if isinstance(key, str) else str(key)
    if not where:
        return _ROOT
    return _IN_ATTRIBUTES if where == "attributes" or where.startswith("attributes.") else _OUTSIDE


def _leaf_problem(item: Any) -> bool:
    if isinstance(item, str):
        return not item.isascii() and _has_surrogate(item)
    if isinstance(item, bool):
        return False
    if isinstance(item, int):
        return not INT64_MIN <= item <= INT64_MAX
    if isinstance(item, float):
        return not math.isfinite(item)
    return False


def first_problem(value: Any, path: str) -> str | None:
    items = 0
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _has_surrogate(item):
                return f"{where or 'value'}: not valid UTF-8 (contains a lone surrogate)"
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int):
            if not INT64_MIN <= item <= INT64_MAX:
                return f"{where or 'value'}: {_INT64_MESSAGE}"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{where or 'value'}: number out of range: must be finite"
        elif isinstance(item, dict | list):
            in_attributes = where == "attributes" or where.startswith("attributes.")
            if in_attributes:
                items += len(item)
                if items > MAX_ATTRIBUTE_ITEMS:
                    return f"attributes: more than {MAX_ATTRIBUTE_ITEMS} keys and items"
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                inner = f"{where}.{key}" if where else str(key)
                if isinstance(key, str):
                    if _has_surrogate(key):
                        return f"{where or 'a top-level'} key: not valid UTF-8 (contains a lone surrogate)"
                    if in_attributes and len(key) > MAX_ATTRIBUTE_KEY_LENGTH:
                        return f"{where}: a key is longer than {MAX_ATTRIBUTE_KEY_LENGTH} characters"
                    inner = f"{where}.{key[:40]}" if where else key[:40]
                stack.append((child, inner))
    return None


def _has_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def describe_validation_error(error: ValidationError, prefix: str = "") -> str:
    """One line naming each bad field, e.g. `attributes.code: Input should be ...`."""
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in (prefix, *item["loc"]) if p != "")
        message = item["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def event_time(value: datetime) -> str:
    """RFC 3339 in UTC with a `Z`, the form every writer of ours uses."""
    return value.isoformat().replace("+00:00", "Z")
