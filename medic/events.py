"""The public fault-event schema (documented in docs/events.md).

One JSON object per event. The envelope is the same for every kind; `attributes` carries
what is specific to a kind and is validated per kind, so a typo in an XID code is caught
at the door instead of deep inside a policy rule.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import (
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
}


class FaultEvent(BaseModel):
    """One fault signal from one source about one node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200, description="Unique; a repeated id is ignored.")
    time: AwareDatetime = Field(description="When the fault happened (RFC 3339 with a UTC offset).")
    source: str = Field(min_length=1, max_length=200, description="Who saw it: agent, dcgm, slurm, job...")
    kind: EventKind
    node: str = Field(min_length=1, max_length=200)
    gpu: NonNegativeInt | None = None
    job: str | None = Field(default=None, max_length=200)
    rank: NonNegativeInt | None = None
    iteration: NonNegativeInt | None = None
    switch: str | None = Field(default=None, max_length=200, description="Leaf switch or rack.")
    attributes: dict[str, Any] = Field(default_factory=dict)

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
        object.__setattr__(self, "attributes", typed.model_dump(mode="json", exclude_none=True))
        return self

    def typed_attributes(self) -> _Attributes:
        return ATTRIBUTE_MODELS[self.kind].model_validate(self.attributes)


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
