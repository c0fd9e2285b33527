"""Recovery measured end to end on a real Slurm cluster: the `measured` profile's source (docs/simulate.md).

The end-to-end recovery benchmark (tests/bench/recovery.py, `PYTHONPATH=tests python -m bench.recovery`) rewrites the
package's data/recovery-measured.json: for each recovery path, each phase's p50 and p95 in seconds,
from the fault injected to the job's first completed step after it. This module reads and checks it.
"""

from __future__ import annotations

import json
from enum import StrEnum
from functools import cache
from importlib import resources
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from medic.errors import PermanentError
from medic.events import describe_validation_error

MEASURED_FILE = "data/recovery-measured.json"  # within the installed medic package
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class MeasurementError(PermanentError):
    """Raised when the measured recovery file is missing, not JSON, or not the benchmark's shape."""


class RecoveryPath(StrEnum):
    IN_PLACE = "in-place"  # the node stays in service: torchrun restarts the group, no requeue
    RESET = "reset"  # the GPU is reset; the job is requeued and waits for that node
    SPARE = "spare"  # the node must go; the job is requeued onto a spare at once
    NO_SPARE = "no-spare"  # the node must go; the job waits for it to reboot
    HANG = "hang"  # every rank hung in one collective: named from their stalls, requeued onto its nodes


class Percentiles(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    p50: Seconds
    p95: Seconds

    @model_validator(mode="after")
    def _ordered(self) -> Percentiles:
        if self.p95 < self.p50:
            raise ValueError(f"p95 ({self.p95}) is below p50 ({self.p50})")
        return self


class Measurement(BaseModel):
    """The file as the benchmark writes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(min_length=1)
    measured_at: str = Field(min_length=1)
    machine: str = Field(min_length=1)
    load: list[Annotated[float, Field(ge=0)]]  # load average at the start and after each path
    runs: int = Field(ge=1)  # per path
    cred_expire_s: Seconds  # Slurm's `AuthInfo cred_expire` there: a requeued job waits it out
    paths: dict[RecoveryPath, dict[str, Percentiles]]

    @model_validator(mode="after")
    def _every_path_timed(self) -> Measurement:
        for path in RecoveryPath:
            phases = self.paths.get(path)
            if phases is None:
                raise ValueError(f"paths: no {path.value!r} path")
            for phase in ("detect", "total"):
                if phase not in phases:
                    raise ValueError(f"paths.{path.value}: no {phase!r} phase")
            if phases["total"].p50 < phases["detect"].p50:
                raise ValueError(f"paths.{path.value}: total's p50 is below detect's")
        return self

    def detection_s(self, path: RecoveryPath) -> float:
        """The path's median from the fault to the incident opened."""
        return self.paths[path]["detect"].p50

    def after_detection_s(self, path: RecoveryPath) -> float:
        """The path's median from the incident opened to the first step: its total less detection,
        which the simulator charges by itself, by how each fault shows."""
        phases = self.paths[path]
        return round(phases["total"].p50 - phases["detect"].p50, 3)


def parse(text: str, where: str) -> Measurement:
    """The measurement in `text`, read from `where` (named in the error)."""
    try:
        return Measurement.model_validate(json.loads(text))
    except json.JSONDecodeError as error:
        raise MeasurementError(f"{where}: not JSON: {error}") from None
    except ValidationError as error:
        raise MeasurementError(f"{where}: {describe_validation_error(error)}") from None


@cache
def shipped() -> Measurement:
    """The measurement installed with the package."""
    where = f"medic/{MEASURED_FILE}"
    try:
        text = resources.files("medic").joinpath(MEASURED_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MeasurementError(
            f"{where}: missing; `PYTHONPATH=tests python -m bench.recovery` writes it"
        ) from None
    return parse(text, where)
