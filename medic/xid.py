"""NVIDIA's XID catalog as data, and what GPU Medic does for each of its resolution buckets.

The catalog (medic/data/xid_catalog.csv) is NVIDIA's "Xid Catalog" for Ampere and newer GPUs:
every code NVIDIA lists, with its "Resolution Bucket (Immediate Action)". The source and how to
refresh it are in the file's header and tests/fixtures/xid/SOURCES.md; docs/xid.md shows the
whole table, code -> NVIDIA's bucket -> our action (`python -m medic.xid --write docs/xid.md`).

NVIDIA's bucket -> our action (`ACTIONS`; the default policy's catalog rules follow it, and
tests/domain/test_xid_catalog.py checks that they do for every code):

- RESTART_APP: no node action; the job restarts from its checkpoint (software).
- IGNORE: record only.
- RESET_GPU, WORKFLOW_XID_48: reset_gpu (the driver or the GPU needs a reset).
- RESTART_BM, RESTART_VM: reboot (our nodes are the bare metal or the VM).
- CONTACT_SUPPORT, UPDATE_SWFW, no bucket listed, a code not in the catalog: escalate (humans
  decide; nothing automatic is safe).
- WORKFLOW_NVLINK_ERR, WORKFLOW_NVLINK5_ERR: diagnose at level 2 (drain, then DCGM's NVLink
  diagnostics decide).
- WORKFLOW_XID_45: no node action; the XID beside it decides (solo: restart Fabric Manager).
- CHECK_MECHANICALS: drain (someone must check seating and power).
- CHECK_UVM: record only (reset the GPU only where UVM/vGPU is in use).
- XID_154: the recovery action the driver states in the message (`RECOVERY_ACTIONS`).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from importlib import resources

CATALOG_FILE = "data/xid_catalog.csv"
CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
RECOVERY_ACTION_CODE = 154


class Resolution(StrEnum):
    """NVIDIA's resolution buckets (immediate action), plus two of ours for what has none."""

    RESTART_APP = "RESTART_APP"
    IGNORE = "IGNORE"
    RESET_GPU = "RESET_GPU"
    RESTART_BM = "RESTART_BM"
    RESTART_VM = "RESTART_VM"
    CONTACT_SUPPORT = "CONTACT_SUPPORT"
    WORKFLOW_XID_45 = "WORKFLOW_XID_45"
    WORKFLOW_XID_48 = "WORKFLOW_XID_48"
    WORKFLOW_NVLINK_ERR = "WORKFLOW_NVLINK_ERR"
    WORKFLOW_NVLINK5_ERR = "WORKFLOW_NVLINK5_ERR"
    CHECK_MECHANICALS = "CHECK_MECHANICALS"
    UPDATE_SWFW = "UPDATE_SWFW"
    CHECK_UVM = "CHECK_UVM"
    XID_154 = "XID_154"
    NONE_LISTED = "NONE_LISTED"  # ours: the catalog lists the code without a bucket
    NOT_IN_CATALOG = "NOT_IN_CATALOG"  # ours: a code the catalog does not list


class RecoveryAction(StrEnum):
    """What XID 154 says the GPU now needs (NVML's nvmlDeviceGpuRecoveryAction_t)."""

    NONE = "none"
    GPU_RESET = "gpu_reset"
    NODE_REBOOT = "node_reboot"
    DRAIN_P2P = "drain_p2p"
    DRAIN_AND_RESET = "drain_and_reset"
    RECOVER_IMEX_DOMAIN = "recover_imex_domain"
    BUS_RESET = "bus_reset"
    SYSTEM_REBOOT = "system_reboot"
    UNKNOWN = "unknown"  # an XID 154 whose message we could not read (or had none)


@dataclass(frozen=True, slots=True)
class OurAction:
    action: str  # a policy action (medic.policy.model.Action's values)
    classification: str
    summary: str  # for docs/xid.md


ACTIONS: Mapping[Resolution, OurAction] = {
    Resolution.RESTART_APP: OurAction("none", "software", "none: the job restarts from its checkpoint"),
    Resolution.IGNORE: OurAction("none", "unknown", "none: recorded only"),
    Resolution.RESET_GPU: OurAction("reset_gpu", "hardware", "reset_gpu"),
    Resolution.RESTART_BM: OurAction("reboot", "hardware", "reboot"),
    Resolution.RESTART_VM: OurAction("reboot", "hardware", "reboot (the node is the VM)"),
    Resolution.CONTACT_SUPPORT: OurAction("escalate", "unknown", "escalate: open an NVIDIA support case"),
    Resolution.WORKFLOW_XID_45: OurAction(
        "none", "software", "none: the XID beside it decides (solo: restart Fabric Manager)"
    ),
    Resolution.WORKFLOW_XID_48: OurAction("reset_gpu", "hardware", "reset_gpu"),
    Resolution.WORKFLOW_NVLINK_ERR: OurAction(
        "diagnose", "hardware", "diagnose level 2: drain, DCGM NVLink diagnostics decide"
    ),
    Resolution.WORKFLOW_NVLINK5_ERR: OurAction(
        "diagnose", "hardware", "diagnose level 2: drain, DCGM NVLink diagnostics decide"
    ),
    Resolution.CHECK_MECHANICALS: OurAction("drain", "hardware", "drain: check seating and power cables"),
    Resolution.UPDATE_SWFW: OurAction("escalate", "infrastructure", "escalate: update driver and firmware"),
    Resolution.CHECK_UVM: OurAction("none", "unknown", "none: reset the GPU only if UVM/vGPU is in use"),
    Resolution.XID_154: OurAction("escalate", "unknown", "the recovery action in the message (below)"),
    Resolution.NONE_LISTED: OurAction("escalate", "unknown", "escalate: the catalog gives no action"),
    Resolution.NOT_IN_CATALOG: OurAction("escalate", "unknown", "escalate: not in the catalog"),
}

# XID 154: the driver's recovery action -> our action.
RECOVERY_ACTIONS: Mapping[RecoveryAction, OurAction] = {
    RecoveryAction.NONE: OurAction("none", "unknown", "none: the driver needs nothing more"),
    RecoveryAction.GPU_RESET: OurAction("reset_gpu", "hardware", "reset_gpu"),
    RecoveryAction.NODE_REBOOT: OurAction("reboot", "hardware", "reboot"),
    RecoveryAction.DRAIN_P2P: OurAction("drain", "hardware", "drain"),
    RecoveryAction.DRAIN_AND_RESET: OurAction(
        "reset_gpu", "hardware", "reset_gpu (the node is drained first)"
    ),
    RecoveryAction.RECOVER_IMEX_DOMAIN: OurAction(
        "escalate", "infrastructure", "escalate: recover the IMEX domain"
    ),
    RecoveryAction.BUS_RESET: OurAction("reset_gpu", "hardware", "reset_gpu"),
    RecoveryAction.SYSTEM_REBOOT: OurAction("reboot", "hardware", "reboot"),
    RecoveryAction.UNKNOWN: OurAction("escalate", "unknown", "escalate: the message names no action"),
}

# nvmlDeviceGpuRecoveryAction_t values, as XID 154 prints them: `... to 0x2 (Node Reboot Required)`.
_BY_VALUE: dict[int, RecoveryAction] = {
    0: RecoveryAction.NONE,
    1: RecoveryAction.GPU_RESET,
    2: RecoveryAction.NODE_REBOOT,
    3: RecoveryAction.DRAIN_P2P,
    4: RecoveryAction.DRAIN_AND_RESET,
    5: RecoveryAction.RECOVER_IMEX_DOMAIN,
    6: RecoveryAction.BUS_RESET,
    7: RecoveryAction.SYSTEM_REBOOT,
}
# The texts the catalog names ("None", "GPU Reset Required", ...), and those drivers print.
_BY_TEXT: dict[str, RecoveryAction] = {
    "none": RecoveryAction.NONE,
    "gpu reset required": RecoveryAction.GPU_RESET,
    "pf flr": RecoveryAction.GPU_RESET,
    "node reboot required": RecoveryAction.NODE_REBOOT,
    "os reboot": RecoveryAction.NODE_REBOOT,
    "drain p2p": RecoveryAction.DRAIN_P2P,
    "drain and reset": RecoveryAction.DRAIN_AND_RESET,
}
_RECOVERY = re.compile(
    r"recovery action changed from\s.*?\bto\s+(?:0x(?P<value>[0-9a-f]+))?\s*\(?(?P<text>[^)]*)",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class XidEntry:
    code: int
    name: str
    description: str
    resolution: Resolution  # NVIDIA's immediate action (NONE_LISTED where the catalog has none)
    investigatory: str
    note: str
    source: str

    @property
    def unused(self) -> bool:
        """NVIDIA marks deprecated codes (V100 or earlier) with the description "Unused"."""
        return self.description == "Unused"

    @property
    def ours(self) -> OurAction:
        return ACTIONS[self.resolution]


def _rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))


@cache
def catalog() -> dict[int, XidEntry]:
    """Every code of the catalog, by code (read once)."""
    text = resources.files("medic").joinpath(CATALOG_FILE).read_text(encoding="utf-8")
    entries = {}
    for row in _rows(text):
        entry = XidEntry(
            code=int(row["code"]),
            name=row["name"],
            description=row["description"],
            resolution=Resolution(row["nvidia_resolution"] or Resolution.NONE_LISTED),
            investigatory=row["nvidia_investigatory"],
            note=row["note"],
            source=row["source"],
        )
        entries[entry.code] = entry
    return entries


def lookup(code: int) -> XidEntry | None:
    return catalog().get(code)


def resolution(code: int) -> Resolution:
    """NVIDIA's bucket for `code`; NOT_IN_CATALOG for a code the catalog does not list."""
    entry = catalog().get(code)
    return entry.resolution if entry else Resolution.NOT_IN_CATALOG


def recovery_action(message: str | None) -> RecoveryAction:
    """The action an XID 154 message states: `GPU recovery action changed from 0x0 (None) to
    0x2 (Node Reboot Required)`. The value decides; the text serves where the value is unknown."""
    match = _RECOVERY.search(message or "")
    if match is None:
        return RecoveryAction.UNKNOWN
    if match["value"] is not None and int(match["value"], 16) in _BY_VALUE:
        return _BY_VALUE[int(match["value"], 16)]
    return _BY_TEXT.get((match["text"] or "").strip().lower(), RecoveryAction.UNKNOWN)


# -- docs/xid.md ----------------------------------------------------------------------------

TABLE_START = "<!-- xid-table:start (generated from medic/data/xid_catalog.csv: python -m medic.xid --write docs/xid.md) -->"
TABLE_END = "<!-- xid-table:end -->"


def markdown_table() -> str:
    lines = [
        "| XID | Name | NVIDIA's description | NVIDIA's action | Our action |",
        "|----:|------|----------------------|-----------------|------------|",
    ]
    for entry in sorted(catalog().values(), key=lambda e: e.code):
        bucket = entry.resolution.value if entry.resolution is not Resolution.NONE_LISTED else "(none listed)"
        description = entry.description.replace("|", "\\|")
        lines.append(f"| {entry.code} | `{entry.name}` | {description} | {bucket} | {entry.ours.summary} |")
    return "\n".join(lines)


def with_table(doc: str) -> str:
    """`doc` with the text between the table markers replaced by the current table."""
    head, start, rest = doc.partition(TABLE_START)
    _, end, tail = rest.partition(TABLE_END)
    if not start or not end:
        raise ValueError("the document has no xid-table markers")
    return f"{head}{TABLE_START}\n{markdown_table()}\n{TABLE_END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print (or rewrite in a doc) the XID catalog table.")
    parser.add_argument("--write", metavar="DOC", help="rewrite the table between the markers in DOC")
    args = parser.parse_args(argv)
    if args.write is None:
        print(markdown_table())
        return 0
    with open(args.write, encoding="utf-8") as f:
        doc = f.read()
    with open(args.write, "w", encoding="utf-8") as f:
        f.write(with_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
