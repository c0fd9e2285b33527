"""Recorded `nvidia-smi -q` output (tests/fixtures/nvml/) read back into what NVML answered: the
answers the prolog's quick checks judge, and the NVML shim's state that answers the same.

nvidia-smi prints NVML's answers field by field, `N/A` where NVML answered NotSupported. Only the
fields the quick checks read are taken; one a recording does not show (an excerpt) stays None,
with no reason, as an unanswered field would.
"""

from __future__ import annotations

from pathlib import Path

from nvml_support import NOT_SUPPORTED, ShimState

from medic.integrations.nvml import CLOCK_EVENT_REASONS
from medic.preflight import (
    CLOCKS_FIELD,
    ECC_FIELD,
    PERSISTENCE_FIELD,
    REMAP_FIELD,
    RETIRED_FIELD,
    GpuAnswers,
    NodeAnswers,
)

FIXTURES = Path(__file__).parent / "fixtures" / "nvml"
# nvidia-smi's labels of the clock event reasons -> the names medic/integrations/nvml.py gives them.
CLOCK_LABELS = {
    "idle": "gpu_idle",
    "applications clocks setting": "applications_clocks_setting",
    "sw power cap": "sw_power_cap",
    "hw slowdown": "hw_slowdown",
    "hw thermal slowdown": "hw_thermal_slowdown",
    "hw power brake slowdown": "hw_power_brake_slowdown",
    "sync boost": "sync_boost",
    "sw thermal slowdown": "sw_thermal_slowdown",
    "display clock setting": "display_clock_setting",
}
# The NVML functions behind each field, for the shim to answer NotSupported.
FUNCTIONS = {
    ECC_FIELD: ("nvmlDeviceGetTotalEccErrors",),
    RETIRED_FIELD: ("nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPagesPendingStatus"),
    REMAP_FIELD: ("nvmlDeviceGetRemappedRows",),
    CLOCKS_FIELD: ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
    PERSISTENCE_FIELD: ("nvmlDeviceGetPersistenceMode",),
}
BITS = {name: bit for bit, name in CLOCK_EVENT_REASONS.items()}


def fields(text: str) -> list[dict[str, str]]:
    """Each GPU's fields by path, lower case: `remapped rows/pending` -> `Yes`. Text with no
    `GPU <bus id>` line (an excerpt of one GPU) is one GPU."""
    gpus: list[dict[str, str]] = []
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.strip() == "[...]":
            continue
        if line.startswith("GPU "):
            gpus.append({})
            stack = []
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0 and not gpus:
            continue  # the node's own lines: timestamp, driver version
        if not gpus:
            gpus.append({})
        key, _, value = (part.strip() for part in line.partition(":"))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([name for _, name in stack] + [key.lower()])
        stack.append((indent, key.lower()))
        if value:
            gpus[-1][path] = value
    return gpus


def answers(gpu: dict[str, str], index: int) -> GpuAnswers:
    # `N/A`: NVML answered NotSupported. Remapped rows are one `N/A` line before Ampere, a section after.
    shown = {
        PERSISTENCE_FIELD: gpu.get("persistence mode"),
        RETIRED_FIELD: gpu.get("retired pages/pending page blacklist"),
        REMAP_FIELD: gpu.get("remapped rows", gpu.get("remapped rows/pending")),
        ECC_FIELD: _volatile_uncorrectable(gpu),
    }
    value = {field: None if text == "N/A" else text for field, text in shown.items()}
    reasons = [
        (CLOCK_LABELS[path.rsplit("/", 1)[1]], active)
        for path, active in gpu.items()
        if path.startswith(("clocks event reasons/", "clocks throttle reasons/"))
    ]
    failed = gpu.get("remapped rows/remapping failure occurred")
    return GpuAnswers(
        index,
        ecc_volatile_uncorrected=None if value[ECC_FIELD] is None else int(value[ECC_FIELD]),
        retired_pages_pending=None if value[RETIRED_FIELD] is None else value[RETIRED_FIELD] == "Yes",
        row_remap=None if value[REMAP_FIELD] is None else (value[REMAP_FIELD] == "Yes", failed == "Yes"),
        clock_reasons=tuple(name for name, active in reasons if active == "Active") if reasons else None,
        persistence_mode=None if value[PERSISTENCE_FIELD] is None else value[PERSISTENCE_FIELD] == "Enabled",
        unsupported=frozenset(field for field, text in shown.items() if text == "N/A"),
    )


def _volatile_uncorrectable(gpu: dict[str, str]) -> str | None:
    """What nvidia-smi's `Volatile Uncorr. ECC` column shows (nvmlDeviceGetTotalEccErrors): the sum of
    the volatile uncorrectable counts, SRAM and DRAM (Ampere on), or the double-bit total (before)."""
    counts = [
        value
        for path, value in gpu.items()
        if path.startswith("ecc errors/volatile/")
        and ("uncorrectable" in path or path.endswith("double bit/total"))
    ]
    if not counts:
        return None
    return "N/A" if "N/A" in counts else str(sum(int(c) for c in counts))


def node(text: str) -> NodeAnswers:
    gpus = tuple(answers(gpu, i) for i, gpu in enumerate(fields(text)))
    return NodeAnswers(len(gpus), gpus)


def recorded(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def answer_with_shim(state: ShimState, gpu: GpuAnswers) -> None:
    """Make the shim answer for `gpu.index` what NVML answered for `gpu`."""
    values: dict[str, int] = {}
    if gpu.persistence_mode is not None:
        values["persistence"] = int(gpu.persistence_mode)
    if gpu.ecc_volatile_uncorrected is not None:
        values["dbe_volatile"] = gpu.ecc_volatile_uncorrected
    if gpu.retired_pages_pending is not None:
        values["retired_pending"] = int(gpu.retired_pages_pending)
    if gpu.row_remap is not None:
        values |= {"remap_pending": int(gpu.row_remap[0]), "remap_failure": int(gpu.row_remap[1])}
    if gpu.clock_reasons is not None:
        values["reasons"] = sum(BITS[name] for name in gpu.clock_reasons)
    state.gpu(gpu.index, **values)
    for field in sorted(gpu.unsupported):
        for function in FUNCTIONS[field]:
            state.fail(function, NOT_SUPPORTED, gpu.index)
