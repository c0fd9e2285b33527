"""integrations/kernel_log.py: following a kernel-log file, and reading the driver's XID lines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from integrations.kernel_log import KernelLog, KernelXid, parse_xid


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
        ("NVRM: GPU at PCI:0000:3b:00: GPU-5ba7e1c0", None),
        ("NVRM: Xid (PCI:0000:3b:00): seventy-nine", None),
    ],
)
def test_parse_xid(line: str, xid: KernelXid | None) -> None:
    assert parse_xid(line) == xid


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
