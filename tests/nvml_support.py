"""The NVML shim (tests/nvml_shim/libnvidia-ml.c) for tests and benchmarks: build it, write its state.

nvidia-ml-py loads `libnvidia-ml.so.1` by that name through ctypes, so a process finds the shim
only when LD_LIBRARY_PATH names its directory at start-up: code that reads NVML through the shim
runs in a child process with `shim_env(...)`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIM_SOURCE = Path(__file__).resolve().parent / "nvml_shim" / "libnvidia-ml.c"
STATE_ENV = "MEDIC_NVML_SHIM_STATE"
# NVML return codes the tests force (nvml.h).
NOT_SUPPORTED, DRIVER_NOT_LOADED, FUNCTION_NOT_FOUND, GPU_IS_LOST, UNKNOWN = 3, 9, 13, 15, 999

_built: dict[str, Path] = {}


def build_shim(directory: Path) -> Path:
    """Compile the shim into `directory` once per process; returns the directory holding it."""
    key = str(SHIM_SOURCE.stat().st_mtime_ns)
    if key not in _built:
        directory.mkdir(parents=True, exist_ok=True)
        if shutil.which("gcc") is None:
            raise RuntimeError("the NVML shim is built with gcc: apt-get install gcc libc6-dev")
        subprocess.run(
            [
                "gcc",
                "-shared",
                "-fPIC",
                "-O1",
                "-Wall",
                "-Werror",
                "-o",
                "libnvidia-ml.so.1",
                str(SHIM_SOURCE),
            ],
            cwd=directory,
            check=True,
            capture_output=True,
            text=True,
        )
        _built[key] = directory
    return _built[key]


def pci_bus_id(gpu: int) -> str:
    """The PCI address the shim gives GPU `gpu`, as the kernel log writes it."""
    return f"0000:{0x18 + 0x10 * gpu:02x}:00"


@dataclass
class ShimState:
    """What the shim answers. Every change is written at once (atomically: the shim re-reads
    a file whose inode, size or time changed), so a running process sees it at its next call."""

    path: Path
    count: int = 8
    init_rc: int = 0
    call_rc: int = 0
    init_sleep_ms: int = 0
    gpus: dict[int, dict[str, int]] = field(default_factory=dict)
    rcs: list[tuple[str, int, int | None]] = field(default_factory=list)
    xids: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.write()

    def set(self, **values: int) -> None:
        for name, value in values.items():
            setattr(self, name, value)
        self.write()

    def gpu(self, index: int, **values: int) -> None:
        self.gpus.setdefault(index, {}).update(values)
        self.write()

    def fail(self, function: str, rc: int, gpu: int | None = None) -> None:
        self.rcs.append((function, rc, gpu))
        self.write()

    def xid(self, gpu: int, code: int) -> None:
        self.xids.append((gpu, code))
        self.write()

    def text(self) -> str:
        lines = [f"count {self.count}", f"init_rc {self.init_rc}", f"call_rc {self.call_rc}"]
        lines.append(f"init_sleep_ms {self.init_sleep_ms}")
        lines += [
            f"gpu {i} {key} {value}" for i, values in self.gpus.items() for key, value in values.items()
        ]
        lines += [f"rc {fn} {rc}" + ("" if gpu is None else f" {gpu}") for fn, rc, gpu in self.rcs]
        lines += [f"xid {gpu} {code}" for gpu, code in self.xids]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".shim-state-")
        with os.fdopen(fd, "w") as f:
            f.write(self.text())
        os.replace(tmp, self.path)


def shim_env(library_dir: Path | None, state: ShimState | None) -> dict[str, str]:
    """The environment for a child process: the shim first on the library path (None: no NVML
    library at all, as on a host without a driver)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", STATE_ENV)}
    if library_dir is not None:
        env["LD_LIBRARY_PATH"] = str(library_dir)
    if state is not None:
        env[STATE_ENV] = str(state.path)
    return env


def run_python(code: str, env: dict[str, str], timeout_s: float = 60) -> Any:
    """Run `code` in a child Python that prints one JSON document; return it parsed."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise AssertionError(f"child failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout)
