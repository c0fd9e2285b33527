"""New kernel-log lines since the last look, and the NVIDIA drivers' XID and NVSwitch SXid reports
(parsed into the domain's `KernelXid` and `KernelSxid`, medic/gpu_state.py).

Reads /dev/kmsg (one record per read, non-blocking) or a plain file that something appends to
(a syslog file, `dmesg -w` redirected, a test's file). Lines from before the agent started are
skipped: XIDs that old were someone else's to report.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from pathlib import Path

from medic.gpu_state import KernelSxid, KernelXid

log = logging.getLogger(__name__)

# `NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.`
# Older drivers write no `PCI:` and no pid/name; dmesg and /dev/kmsg put a prefix before `NVRM`.
# On a MIG GPU the driver attributes the XID to a GPU instance, and maybe a compute instance
# (open-gpu-kernel-modules, kernel_rc.c: "PCI:%04x:%02x:%02x GPU-I:%02u GPU-CI:%02u"):
# `NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=..., name=..., Contained: ...`
XID_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?"
    r"(?:\s+GPU-I:(?P<gi>\d+))?(?:\s+GPU-CI:(?P<ci>\d+))?\):\s*"
    r"(?P<code>\d+),\s*"
    r"(?:pid=(?P<pid>'[^']*'|[^,\s]*),\s*)?"
    r"(?:name=(?P<name>[^,]*),\s*)?"
    r"(?P<message>.*?)\s*$"
)
# NVSwitch errors ("switch XIDs"), from the nvswitch driver (NVSWITCH_PRINT_SXID):
# `nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)`
SXID_LINE = re.compile(
    r"nvidia-(?P<device>nvswitch\d+): SXid \((?:PCI:)?"
    r"(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?\):\s*"
    r"(?P<code>\d+)(?:,\s*(?P<message>.*?))?\s*$"
)
_SXID_SEVERITY = re.compile(r"^(?P<severity>Non-fatal|Fatal)\b", re.IGNORECASE)
_SXID_LINK = re.compile(r"\bLink\s+(?P<link>\d+)\b")
MAX_RECORD = 8192  # /dev/kmsg hands out at most this much per record
MAX_BYTES_PER_READ = 4 << 20  # a flood is read over several polls, never all at once


def _bus_id(address: str) -> str:
    domain, bus, device = address.lower().split(":")
    return f"{int(domain, 16):04x}:{bus}:{device}"


def parse_sxid(line: str) -> KernelSxid | None:
    match = SXID_LINE.search(line)
    if match is None:
        return None
    message = match["message"] or ""
    severity = _SXID_SEVERITY.match(message)
    link = _SXID_LINK.search(message)
    return KernelSxid(
        nvswitch=match["device"],
        pci_bus_id=_bus_id(match["pci"]),
        code=int(match["code"]),
        message=message,
        fatal=None if severity is None else severity["severity"].lower() == "fatal",
        link=int(link["link"]) if link else None,
    )


def parse_xid(line: str) -> KernelXid | None:
    match = XID_LINE.search(line)
    if match is None:
        return None
    pid = (match["pid"] or "").strip("'")
    process = (match["name"] or "").strip()
    return KernelXid(
        pci_bus_id=_bus_id(match["pci"]),
        code=int(match["code"]),
        message=match["message"],
        pid=int(pid) if pid.isdigit() else None,
        process=process if process and process != "<unknown>" else None,
        gpu_instance=int(match["gi"]) if match["gi"] else None,
        compute_instance=int(match["ci"]) if match["ci"] else None,
    )


class KernelLog:
    """Tails `path`; `new_lines()` returns complete lines written since the previous call."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._device = False
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file
        self._partial = b""
        self._warned: str | None = None
        self._open(at_end=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def new_lines(self) -> list[str]:
        data = b""
        if self._fd is not None and not self._device:
            data = self._follow_file()
        if self._fd is None:
            # A file that appears (or is rotated in) after we started is new: read it all.
            self._open(at_end=False)
        if self._fd is not None:
            data += self._read_records() if self._device else self._read_appended()
        return data.decode("utf-8", errors="replace").splitlines()

    def _open(self, at_end: bool) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as error:
            self._warn_once(f"cannot read {self.path}: {error.strerror or error}")
            return
        info = os.fstat(fd)
        self._fd, self._device = fd, stat.S_ISCHR(info.st_mode)
        self._identity = (info.st_dev, info.st_ino)
        self._partial = b""
        self._warned = None
        if at_end or self._device:  # /dev/kmsg's start is the boot, never "new"
            os.lseek(fd, 0, os.SEEK_END)

    def _follow_file(self) -> bytes:
        """Keep up with rotation (drain the old file, then close it) and truncation (start over)."""
        assert self._fd is not None
        try:
            info = os.stat(self.path)
        except OSError:
            return b""  # rotated away and not yet recreated: keep reading the old file
        if (info.st_dev, info.st_ino) != self._identity:
            rest = self._read_appended()
            self.close()
            return rest + b"\n" if rest else b""
        if info.st_size < os.lseek(self._fd, 0, os.SEEK_CUR):
            os.lseek(self._fd, 0, os.SEEK_SET)
            self._partial = b""
        return b""

    def _read_appended(self) -> bytes:
        assert self._fd is not None
        data = self._partial + os.read(self._fd, MAX_BYTES_PER_READ)
        complete, _, self._partial = data.rpartition(b"\n")
        return complete

    def _read_records(self) -> bytes:
        """/dev/kmsg: `prio,seq,usec,flags;text` per record; continuation lines start with a space."""
        assert self._fd is not None
        records, size = [], 0
        while size < MAX_BYTES_PER_READ:
            try:
                record = os.read(self._fd, MAX_RECORD)
            except BlockingIOError:
                break
            except OSError as error:
                if error.errno == errno.EPIPE:  # records were overwritten before we read them
                    continue
                raise
            if not record:
                break
            text = record.split(b"\n", 1)[0]
            records.append(text.partition(b";")[2])
            size += len(record)
        return b"\n".join(records)

    def _warn_once(self, message: str) -> None:
        if message != self._warned:
            log.warning("%s", message)
            self._warned = message
