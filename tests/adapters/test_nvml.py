"""medic/integrations/nvml.py through nvidia-ml-py's real ctypes code path, answered by the NVML shim
(tests/nvml_shim/libnvidia-ml.c) in a child process, and on a host with no NVML library at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pynvml
import pytest
from nvml_support import (
    DRIVER_NOT_LOADED,
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    NOT_SUPPORTED,
    UNKNOWN,
    ShimState,
    build_shim,
    pci_bus_id,
    run_python,
    shim_env,
)

from medic.gpu_state import PcieLink
from medic.integrations import nvml
from medic.integrations.nvml import decode_clock_reasons, normalize_pci_bus_id

# Each element of STATES is written as the shim's state before one read of one NvmlSession.
READS = """
import dataclasses, json, os, sys
from medic.integrations.nvml import NvmlSession
path, states = sys.argv[1], json.loads(sys.argv[2])
out = []
with NvmlSession() as session:
    for text in states:
        if text is not None:
            with open(path + ".new", "w") as f:
                f.write(text)
            os.replace(path + ".new", path)
        result = session.read()
        out.append({"type": type(result).__name__, **dataclasses.asdict(result)})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shim(tmp_path_factory.mktemp("nvml-shim"))


@pytest.fixture
def state(tmp_path: Path) -> ShimState:
    return ShimState(tmp_path / "nvml-state")


def reads(shim: Path, state: ShimState, *changes: ShimState | None) -> list[dict[str, Any]]:
    """Read once now, then once after each change (None: read again with nothing changed)."""
    texts = [None, *(c.text() if c else None for c in changes)]
    code = READS.replace("sys.argv[1]", repr(str(state.path))).replace("sys.argv[2]", repr(json.dumps(texts)))
    return run_python(code, shim_env(shim, state))


def read(shim: Path, state: ShimState) -> dict[str, Any]:
    [result] = reads(shim, state)
    return result


def test_a_healthy_node(shim: Path, state: ShimState) -> None:
    node = read(shim, state)
    assert (node["type"], node["driver_version"], node["gpu_count"], len(node["gpus"])) == (
        "NodeSnapshot",
        "550.54.15",
        8,
        8,
    )
    gpu = node["gpus"][3]
    assert gpu["index"] == 3
    assert gpu["uuid"] == "GPU-5ba7e1c0-0000-4000-8000-000000000003"
    assert gpu["pci_bus_id"] == pci_bus_id(3) == "0000:48:00"
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["ecc"] == dict.fromkeys(
        ("volatile_corrected", "volatile_uncorrected", "aggregate_corrected", "aggregate_uncorrected"), 0
    )
    assert gpu["row_remap"] == {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False}
    assert gpu["retired_pages"] == {"sbe": 0, "dbe": 0, "pending": False}
    assert (gpu["temperature_c"], gpu["clock_reasons"], gpu["power_w"]) == (45, ["gpu_idle"], 310.0)
    assert gpu["pcie"] == {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16}
    assert gpu["nvlinks"] == {str(link): True for link in range(18)}
    assert (gpu["lost"], gpu["errors"]) == (False, [])
    assert node["xids"] == []


def test_counters_and_states_are_read_per_gpu(shim: Path, state: ShimState) -> None:
    state.gpu(
        2,
        sbe_volatile=7,
        dbe_volatile=2,
        sbe_aggregate=40,
        dbe_aggregate=3,
        retired_sbe=2,
        retired_dbe=1,
        retired_pending=1,
        remap_corrected=4,
        remap_uncorrected=1,
        remap_pending=1,
        temp=93,
        reasons=0x4 | 0x40 | (1 << 40),
        power_mw=412_500,
        pcie_gen=3,
        pcie_width=8,
        nvlinks=4,
        nvlink_down=0b0010,
    )
    gpu = read(shim, state)["gpus"][2]
    assert gpu["ecc"] == {
        "volatile_corrected": 7,
        "volatile_uncorrected": 2,
        "aggregate_corrected": 40,
        "aggregate_uncorrected": 3,
    }
    assert gpu["retired_pages"] == {"sbe": 2, "dbe": 1, "pending": True}
    assert gpu["row_remap"] == {"corrected": 4, "uncorrected": 1, "pending": True, "failure": False}
    assert gpu["temperature_c"] == 93
    assert gpu["clock_reasons"] == ["sw_power_cap", "hw_thermal_slowdown", "bit_40"]
    assert gpu["power_w"] == 412.5
    assert gpu["pcie"] == {"gen": 3, "max_gen": 5, "width": 8, "max_width": 16}
    assert gpu["nvlinks"] == {"0": True, "1": False, "2": True, "3": True}


def test_not_supported_is_none_never_zero(shim: Path, state: ShimState) -> None:
    for function in (
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetMaxPcieLinkWidth",
    ):
        state.fail(function, NOT_SUPPORTED, gpu=1)
    state.gpu(1, nvlinks=0)  # a board without NVLink answers NotSupported for every link
    node = read(shim, state)
    gpu = node["gpus"][1]
    assert gpu["ecc"] == dict.fromkeys(gpu["ecc"])  # every count None
    assert (gpu["retired_pages"], gpu["row_remap"], gpu["temperature_c"], gpu["power_w"]) == (None,) * 4
    assert (gpu["clock_reasons"], gpu["nvlinks"]) == (None, None)
    assert gpu["pcie"] == {"gen": 5, "max_gen": 5, "width": 16, "max_width": None}
    assert (gpu["lost"], gpu["errors"]) == (False, [])
    assert node["gpus"][0]["temperature_c"] == 45  # only GPU 1 was told to refuse


def test_old_drivers_give_clock_reasons_under_the_throttle_name(shim: Path, state: ShimState) -> None:
    state.fail("nvmlDeviceGetCurrentClocksEventReasons", FUNCTION_NOT_FOUND)
    state.gpu(0, reasons=0x20)
    assert read(shim, state)["gpus"][0]["clock_reasons"] == ["sw_thermal_slowdown"]


def test_other_errors_are_recorded_on_the_gpu(shim: Path, state: ShimState) -> None:
    state.fail("nvmlDeviceGetPowerUsage", UNKNOWN, gpu=4)
    gpu = read(shim, state)["gpus"][4]
    assert (gpu["power_w"], gpu["errors"], gpu["lost"]) == (None, ["power: Unknown Error"], False)
    assert gpu["temperature_c"] == 45


def test_a_lost_gpu_is_reported_on_that_gpu(shim: Path, state: ShimState) -> None:
    state.gpu(5, lost=1)
    # GPU 6 falls off the bus in the middle of being read: what was read before still names it.
    state.fail("nvmlDeviceGetTemperature", GPU_IS_LOST, gpu=6)
    node = read(shim, state)
    assert node["type"] == "NodeSnapshot"
    assert [g["index"] for g in node["gpus"] if g["lost"]] == [5, 6]
    assert node["gpus"][5]["uuid"] is None
    assert node["gpus"][6]["uuid"] == "GPU-5ba7e1c0-0000-4000-8000-000000000006"
    assert node["gpus"][6]["pci_bus_id"] == pci_bus_id(6)
    assert node["gpus"][6]["temperature_c"] is None
    assert not any(g["lost"] for g in node["gpus"] if g["index"] not in (5, 6))


def test_xids_arrive_through_the_event_set_between_reads(shim: Path, state: ShimState) -> None:
    state.fail("nvmlDeviceRegisterEvents", NOT_SUPPORTED, gpu=1)  # this GPU has no NVML XIDs
    later = ShimState(state.path.with_name("later"), xids=[(2, 79), (1, 48), (6, 13)])
    first, second, third = reads(shim, state, later, None)
    assert first["xids"] == []
    assert second["xids"] == [{"gpu": 2, "code": 79}, {"gpu": 6, "code": 13}]
    assert third["xids"] == []  # each XID is delivered once


def test_a_driver_that_goes_away_and_comes_back(shim: Path, state: ShimState) -> None:
    gone = ShimState(state.path.with_name("gone"), init_rc=DRIVER_NOT_LOADED, call_rc=UNKNOWN)
    back = ShimState(state.path.with_name("back"))
    before, during, still, after = reads(shim, state, gone, None, back)
    assert before["type"] == after["type"] == "NodeSnapshot"
    assert during == {"type": "Unavailable", "reason": "NVML: Unknown Error"}
    assert still == {"type": "Unavailable", "reason": "NVML: Driver Not Loaded"}  # re-init refused
    assert after["gpu_count"] == 8


def test_no_driver_is_unavailable(state: ShimState) -> None:
    code = "import json; from medic.integrations.nvml import snapshot; print(json.dumps(repr(snapshot())))"
    assert (
        run_python(code, shim_env(None, None)) == "Unavailable(reason='NVML: NVML Shared Library Not Found')"
    )


def test_driver_not_loaded_is_unavailable(shim: Path, state: ShimState) -> None:
    state.set(init_rc=DRIVER_NOT_LOADED)
    assert read(shim, state) == {"type": "Unavailable", "reason": "NVML: Driver Not Loaded"}


@pytest.mark.parametrize(
    ("mask", "names"),
    [
        (0, ()),
        (0x1, ("gpu_idle",)),
        (0x4 | 0x8 | 0x80, ("sw_power_cap", "hw_slowdown", "hw_power_brake_slowdown")),
        (0x20 | 0x40, ("sw_thermal_slowdown", "hw_thermal_slowdown")),
        (0x100 | (1 << 12), ("display_clock_setting", "bit_12")),
    ],
)
def test_clock_reason_bits_are_named(mask: int, names: tuple[str, ...]) -> None:
    assert decode_clock_reasons(mask) == names


@pytest.mark.parametrize(
    ("bus_id", "normalized"),
    [
        ("00000000:3B:00.0", "0000:3b:00"),
        ("0000:3b:00", "0000:3b:00"),
        ("PCI:0001:AF:00.0", "0001:af:00"),
    ],
)
def test_pci_bus_ids_from_nvml_and_the_kernel_log_agree(bus_id: str, normalized: str) -> None:
    assert normalize_pci_bus_id(bus_id) == normalized


@pytest.mark.parametrize(
    ("link", "idle", "problems"),
    [
        (PcieLink(5, 5, 16, 16), False, ()),
        (PcieLink(1, 5, 16, 16), True, ()),  # an idle GPU lowers its generation to save power
        (PcieLink(3, 5, 16, 16), False, ("gen",)),
        (PcieLink(5, 5, 8, 16), True, ("width",)),
        (PcieLink(3, 5, 8, 16), False, ("width", "gen")),
        (PcieLink(None, 5, None, 16), False, ()),  # unknown is not degraded
    ],
)
def test_pcie_link_problems(link: PcieLink, idle: bool, problems: tuple[str, ...]) -> None:
    assert link.problems(idle) == problems


def test_nvlink_error_counters_are_summed_over_links(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {  # (link, counter) -> value; link 1 has no ECC counter, link 2 fails once
        (0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 3,
        (0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 1,
        (0, pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA): 2,
        (1, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 4,
    }

    def counter(handle: object, link: int, which: int) -> int:
        if link == 2 and which == pynvml.NVML_NVLINK_ERROR_DL_RECOVERY:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        if (link, which) not in counts and which == pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return counts.get((link, which), 0)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkErrorCounter", counter)
    reader = nvml._Reader(object())
    assert nvml._nvlink_errors(reader, (0, 1, 2)) == {
        "replay": 7,
        "recovery": 0,
        "crc_flit": 1,
        "crc_data": 0,
        "ecc_data": 2,
    }
    assert reader.errors == ["nvlink 2 recovery errors: Unknown Error"]
    assert nvml._nvlink_errors(nvml._Reader(object()), ()) is None


def test_nvlink_error_counters_on_a_gpu_without_nvlink(monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(handle: object, link: int, which: int) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkErrorCounter", unsupported)
    assert nvml._nvlink_errors(nvml._Reader(object()), (0, 1)) is None


@pytest.mark.parametrize("answer", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND])
def test_an_nvlink_counter_never_answered_is_asked_once(monkeypatch: pytest.MonkeyPatch, answer: int) -> None:
    asked: list[tuple[int, int]] = []

    def counter(handle: object, link: int, which: int) -> int:
        asked.append((link, which))
        if which == pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA:
            raise pynvml.NVMLError(answer)
        if which == pynvml.NVML_NVLINK_ERROR_DL_RECOVERY:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)  # may answer next time
        return 1

    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkErrorCounter", counter)
    never: set[str] = set()  # the session's, kept across reads
    first = nvml._nvlink_errors(nvml._Reader(object(), never), (0, 1))
    asked_first = len(asked)
    again = nvml._Reader(object(), never)
    assert nvml._nvlink_errors(again, (0, 1)) == first == {"replay": 2, "crc_flit": 2, "crc_data": 2}
    assert asked_first == 10
    assert len(asked) - asked_first == 8  # ecc_data not asked again on either link; recovery is
    assert again.errors == [
        "nvlink 0 recovery errors: Unknown Error",
        "nvlink 1 recovery errors: Unknown Error",
    ]
    assert {"nvlink 0 ecc_data errors", "nvlink 1 ecc_data errors"} <= never


def test_a_field_the_gpu_never_answers_is_asked_once_per_driver_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[int] = []

    def retired_pages(handle: object, cause: int) -> list[int]:
        asked.append(cause)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # Hopper: rows are remapped instead

    def temperature(handle: object, sensor: int) -> int:
        asked.append(-1)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)  # may answer next time: asked again

    monkeypatch.setattr(pynvml, "nvmlDeviceGetRetiredPages", retired_pages)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", temperature)
    never: set[str] = set()
    for _ in range(3):  # three reads of one GPU in one session
        reader = nvml._Reader(object(), never)
        assert reader.get("retired pages (sbe)", pynvml.nvmlDeviceGetRetiredPages, 1) is None
        assert reader.get("temperature", pynvml.nvmlDeviceGetTemperature, 0) is None
    assert asked == [1, -1, -1, -1]
    assert never == {"retired pages (sbe)"}


def test_a_field_never_answered_is_asked_again_only_after_the_driver_comes_back(
    shim: Path, state: ShimState
) -> None:
    state.fail("nvmlDeviceGetTemperature", NOT_SUPPORTED, gpu=1)
    answers = ShimState(state.path.with_name("answers"))  # as if it could answer now
    gone = ShimState(state.path.with_name("gone"), init_rc=DRIVER_NOT_LOADED, call_rc=UNKNOWN)
    back = ShimState(state.path.with_name("back"))
    first, cached, _, after = reads(shim, state, answers, gone, back)
    assert [r["gpus"][1]["temperature_c"] for r in (first, cached, after)] == [None, None, 45]
    assert cached["gpus"][0]["temperature_c"] == 45  # only GPU 1 said NotSupported
