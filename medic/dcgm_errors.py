"""DCGM's own verdict on each diagnostic error: severity and category, from NVIDIA's table.

The table ships as data (medic/data/dcgm_errors.csv) so it can be refreshed from a newer DCGM
release without touching code. It is DCGM 4.6's (`dcgmErrorMeta` in dcgmlib/src/dcgm_errors.c,
ids 0-132); tests/adapters/test_dcgm_parse.py diffs it against the copy of NVIDIA's header and table kept
in tests/fixtures/dcgm/nvidia/. DCGM 3.x uses the same ids for the errors it has.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from importlib import resources


class Severity(StrEnum):
    """What DCGM says to do about an error, from least to most drastic."""

    UNKNOWN = "UNKNOWN"
    MONITOR = "MONITOR"
    CONFIG = "CONFIG"
    TRIAGE = "TRIAGE"
    RESET = "RESET"
    ISOLATE = "ISOLATE"


# dcgmErrorSeverity_t (dcgm_errors.h): the number `dcgmi diag -j` prints as `error_severity`.
# 0 is DCGM_ERROR_NONE, which medic has no use for: it reads as UNKNOWN, like any other number.
SEVERITY_IDS: dict[int, Severity] = {
    1: Severity.MONITOR,
    2: Severity.ISOLATE,
    3: Severity.UNKNOWN,
    4: Severity.TRIAGE,
    5: Severity.CONFIG,
    6: Severity.RESET,
}

# dcgmErrorCategory_t (dcgm_errors.h, DCGM_FR_EC_*): the number printed as `error_category`.
CATEGORY_IDS: dict[int, str] = {
    0: "NONE",
    1: "PERF_THRESHOLD",
    2: "PERF_VIOLATION",
    3: "SOFTWARE_CONFIG",
    4: "SOFTWARE_LIBRARY",
    5: "SOFTWARE_XID",
    6: "SOFTWARE_CUDA",
    7: "SOFTWARE_EUD",
    8: "SOFTWARE_OTHER",
    9: "HARDWARE_THERMAL",
    10: "HARDWARE_MEMORY",
    11: "HARDWARE_NVLINK",
    12: "HARDWARE_NVSWITCH",
    13: "HARDWARE_PCIE",
    14: "HARDWARE_POWER",
    15: "HARDWARE_OTHER",
    16: "INTERNAL_OTHER",
}


@dataclass(frozen=True, slots=True)
class DcgmError:
    id: int
    name: str
    severity: Severity
    category: str


@cache
def _table() -> dict[str | int, DcgmError]:
    text = resources.files("medic").joinpath("data/dcgm_errors.csv").read_text(encoding="utf-8")
    table: dict[str | int, DcgmError] = {}
    for row in csv.DictReader(text.splitlines()):
        error = DcgmError(int(row["error_id"]), row["name"], Severity(row["severity"]), row["category"])
        table[error.id] = error
        table[error.name] = error
    return table


def lookup(error: int | str) -> DcgmError | None:
    """Find an error by numeric id, by `DCGM_FR_*` name, or by a numeric string."""
    key: int | str = int(error) if isinstance(error, str) and error.isdigit() else error
    return _table().get(key)


def stated(error_id: int, severity_id: int | None, category_id: int | None) -> DcgmError:
    """An error the table does not know, with the severity and category the output states for it
    (`error_severity`, `error_category`); UNKNOWN where it states none or a number DCGM does not
    define. Its name is its number."""
    severity = (
        SEVERITY_IDS.get(severity_id, Severity.UNKNOWN) if severity_id is not None else Severity.UNKNOWN
    )
    category = CATEGORY_IDS.get(category_id, "UNKNOWN") if category_id is not None else "UNKNOWN"
    return DcgmError(error_id, str(error_id), severity, category)


def all_errors() -> list[DcgmError]:
    return sorted({e.id: e for e in _table().values()}.values(), key=lambda e: e.id)


def worst(severities: Iterable[Severity]) -> Severity | None:
    """The most drastic of `severities` (Severity's declaration order), None when there are none."""
    order = list(Severity)
    return max(severities, key=order.index, default=None)
