"""medic/integrations/kernel_log.py: following a kernel-log file, and reading the driver's XID lines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from medic.gpu_state import KernelSxid, KernelXid
from medic.integrations.kernel_log import KernelLog, parse_sxid, parse_xid


@pytest.mark.parametrize(
    ("line", "xid"),
    [
        (
            "[ 8123.409] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            KernelXid("0000:3b:00", 79, "GPU has fallen off the bus."),
        ),
        (  # /dev/kmsg's record prefix; a driver that names the process
            "4,1234,5678901,-;NVRM: Xid (PCI:0000:B3:00): 13, pid=4412, name=python3, Graphics SM Warp Exception",
            KernelXid("0000:b3:00", 13, "Graphics SM Warp Exception", 4412, "python3"),
        ),
        (  # older drivers: no `PCI:`, no pid or name
            "NVRM: Xid (0000:18:00): 48, An uncorrectable double bit error (DBE) has been detected.",
            KernelXid("0000:18:00", 48, "An uncorrectable double bit error (DBE) has been detected."),
        ),
        (  # MIG: the driver attributes the XID to a GPU instance (kernel_rc.c)
            "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=2211, name=python3, Contained: SM (0x1). RST: No, D-RST: No",
            KernelXid("0000:01:00", 94, "Contained: SM (0x1). RST: No, D-RST: No", 2211, "python3", 5),
        ),
        (  # ... and to a compute instance too
            "NVRM: Xid (PCI:0000:01:00 GPU-I:03 GPU-CI:01): 13, pid=2212, name=python3, Graphics SM Warp Exception",
            KernelXid("0000:01:00", 13, "Graphics SM Warp Exception", 2212, "python3", 3, 1),
        ),
        (  # XID 154 names the recovery action in its message
            "NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
            KernelXid(
                "0008:01:00", 154, "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
            ),
        ),
        (
            "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error",
            None,
        ),
        ("NVRM: GPU at PCI:0000:3b:00: GPU-5ba7e1c0", None),
        ("NVRM: Xid (PCI:0000:3b:00): seventy-nine", None),
    ],
)
def test_parse_xid(line: str, xid: KernelXid | None) -> None:
    assert parse_xid(line) == xid


@pytest.mark.parametrize(
    ("line", "sxid"),
    [
        (  # the nvswitch driver's NVSWITCH_PRINT_SXID: "nvidia-%s: SXid (PCI:...): %05d, ..."
            "[ 9100.000] nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)",
            KernelSxid(
                "nvswitch0",
                "0000:05:00",
                12028,
                "Non-fatal, Link 32 egress non-posted PRIV error (First)",
                False,
                32,
            ),
        ),
        (
            "4,99,123,-;nvidia-nvswitch3: SXid (PCI:0000:C1:00.0): 24007, Fatal, Link 30 sourcetrack timeout error",
            KernelSxid(
                "nvswitch3", "0000:c1:00", 24007, "Fatal, Link 30 sourcetrack timeout error", True, 30
            ),
        ),
        (  # severity and link are optional
            "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 01001",
            KernelSxid("nvswitch1", "0000:06:00", 1001, ""),
        ),
        ("nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): garbled, Fatal", None),
        ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", None),
    ],
)
def test_parse_sxid(line: str, sxid: KernelSxid | None) -> None:
    assert parse_sxid(line) == sxid


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def test_only_lines_written_after_the_start_count(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    path.write_bytes(b"old line\n")
    log = KernelLog(path)
    assert log.new_lines() == []
    append(path, b"one\ntw")
    assert log.new_lines() == ["one"]  # half a line waits for its end
    append(path, b"o\n\xff bytes that are not UTF-8\n")
    assert log.new_lines() == ["two", "\ufffd bytes that are not UTF-8"]
    assert log.new_lines() == []


def test_rotation_and_truncation(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    path.write_bytes(b"")
    log = KernelLog(path)
    append(path, b"before rotation\n")
    os.rename(path, tmp_path / "kern.log.1")
    append(tmp_path / "kern.log.1", b"last words of the old file\n")
    assert log.new_lines() == ["before rotation", "last words of the old file"]
    path.write_bytes(b"first of the new file\n")
    assert log.new_lines() == ["first of the new file"]
    append(path, b"more\n")
    assert log.new_lines() == ["more"]
    path.write_bytes(b"")  # truncated in place (copytruncate)
    append(path, b"after truncation\n")
    assert log.new_lines() == ["after truncation"]


def test_a_file_that_appears_later_is_read_from_its_start(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    log = KernelLog(path)
    assert log.new_lines() == []
    path.write_bytes(b"NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n")
    [line] = log.new_lines()
    assert parse_xid(line) == KernelXid("0000:3b:00", 79, "GPU has fallen off the bus.")
