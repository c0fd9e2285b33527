"""DCGM's own verdict on each diagnostic error: severity and category, from NVIDIA's table.

The table ships as data (medic/data/dcgm_errors.csv) so it can be refreshed from a newer DCGM
release without touching code.
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


def all_errors() -> list[DcgmError]:
    return sorted({e.id: e for e in _table().values()}.values(), key=lambda e: e.id)


def worst(severities: Iterable[Severity]) -> Severity | None:
    """The most drastic of `severities` (Severity's declaration order), None when there are none."""
    order = list(Severity)
    return max(severities, key=order.index, default=None)
