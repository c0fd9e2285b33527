"""`HostEvidence` read on the node itself, through the runner DCGM and the NVML probe use (ssh, srun
or local; medic/integrations/dcgm/runner.py): the kernel log's GPU lines, `nvidia-smi -q`, and an
`nvidia-bug-report.sh` report where the node has that script.

The cheap parts run first, so a slow or hung bug report can only cost itself: each part gets what is
left of the one time limit, and what does not come back is said in `missing`, never raised.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime

from medic.integrations.dcgm.diagnostics import NODE_NAME
from medic.integrations.dcgm.runner import Completed, NodeRunner, runner_from_env
from medic.protocols import HostCapture, HostFile

# dmesg may be closed to a user that is not root (kernel.dmesg_restrict); the journal keeps the
# same lines for the current boot.
KERNEL_LOG = ("sh", "-c", "dmesg 2>/dev/null || journalctl -k -b --no-pager -q")
NVIDIA_SMI = ("nvidia-smi", "-q")
BUG_REPORT_SCRIPT = "nvidia-bug-report.sh"
ABSENT = "medic: absent"
# The report is a gzip file: base64 carries it through a runner that reads text. --safe-mode skips
# the parts of the script known to hang on a wedged GPU.
BUG_REPORT = (
    "sh",
    "-c",
    f"command -v {BUG_REPORT_SCRIPT} >/dev/null 2>&1 || {{ echo '{ABSENT}'; exit 0; }}\n"
    "d=$(mktemp -d) || exit 1\ntrap 'rm -rf \"$d\"' EXIT\n"
    f'{BUG_REPORT_SCRIPT} --safe-mode --output-file "$d/report.log" >&2 || exit 1\n'
    'if [ -f "$d/report.log.gz" ]; then base64 "$d/report.log.gz"; else gzip -c "$d/report.log" | base64; fi',
)
# The lines the drivers write about GPUs, NVLink and NVSwitches; the rest of the log is not ours to keep.
GPU_LINE = re.compile(r"NVRM|\bS?Xid\b|nvidia|nvswitch|nvlink|\bGPU\b", re.IGNORECASE)
KERNEL_LOG_LINES = 2000  # the newest: what led up to the action matters more than the boot
KERNEL_LOG_BYTES = 256 << 10
NVIDIA_SMI_BYTES = 4 << 20  # a whole 8-GPU H100 node prints about 80 KiB
BUG_REPORT_BYTES = 64 << 20
# The first parts are quick when the driver answers; past these they are taken as hung.
KERNEL_LOG_S = 20.0
NVIDIA_SMI_S = 30.0
MIN_PART_S = 1.0  # less than this left: not started at all


def gpu_lines(log: str, max_lines: int = KERNEL_LOG_LINES, max_bytes: int = KERNEL_LOG_BYTES) -> str:
    """The kernel log's GPU lines, the newest `max_lines` of them and no more than `max_bytes`."""
    kept = [line for line in log.splitlines() if GPU_LINE.search(line)][-max_lines:]
    text, size = [], 0
    for line in reversed(kept):
        size += len(line.encode()) + 1
        if size > max_bytes:
            break
        text.append(line)
    return "".join(f"{line}\n" for line in reversed(text))


class NodeHostEvidence:
    def __init__(self, runner: NodeRunner) -> None:
        self.runner = runner

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NodeHostEvidence:
        """The runner DCGM uses (MEDIC_DCGM_RUNNER & co)."""
        return cls(runner_from_env(env))

    def capture(self, node: str, timeout_s: float) -> HostCapture:
        started = datetime.now(UTC)
        if not NODE_NAME.fullmatch(node):
            why = f"{node!r} is not a node name a command can be sent to"
            return HostCapture(node, missing=(why,), started_at=started, finished_at=datetime.now(UTC))
        deadline = time.monotonic() + timeout_s
        files: list[HostFile] = []
        missing: list[str] = []

        def run(what: str, argv: tuple[str, ...], cap_s: float | None = None) -> Completed | None:
            left = deadline - time.monotonic()
            limit = left if cap_s is None else min(cap_s, left)
            if limit < MIN_PART_S:
                missing.append(f"{what}: not started, the {timeout_s:g} s for the evidence were spent")
                return None
            done = self.runner.run(node, argv, limit)
            why = done.failure(what, limit)
            if why:
                missing.append(why)
                return None
            return done

        log = run("kernel log", KERNEL_LOG, KERNEL_LOG_S)
        if log is not None:
            lines = gpu_lines(log.stdout)
            if lines:
                files.append(HostFile("kernel-log.txt", "kernel log (NVRM, Xid, GPU lines)", lines.encode()))
            else:
                missing.append("kernel log: no NVRM, Xid or GPU lines")
        smi = run("nvidia-smi -q", NVIDIA_SMI, NVIDIA_SMI_S)
        if smi is not None:
            files.append(
                HostFile("nvidia-smi-q.txt", "nvidia-smi -q", smi.stdout.encode()[:NVIDIA_SMI_BYTES])
            )
        report = run(BUG_REPORT_SCRIPT, BUG_REPORT)
        if report is not None:
            self._bug_report(node, report, files, missing)
        return HostCapture(node, tuple(files), tuple(missing), started, datetime.now(UTC))

    @staticmethod
    def _bug_report(node: str, done: Completed, files: list[HostFile], missing: list[str]) -> None:
        if done.stdout.strip() == ABSENT:
            missing.append(f"{BUG_REPORT_SCRIPT}: not installed on {node}")
            return
        try:
            report = base64.b64decode("".join(done.stdout.split()), validate=True)
        except (binascii.Error, ValueError) as error:
            missing.append(f"{BUG_REPORT_SCRIPT}: its report came back unreadable ({error})")
            return
        if not report:
            missing.append(f"{BUG_REPORT_SCRIPT}: wrote an empty report")
        elif len(report) > BUG_REPORT_BYTES:
            missing.append(
                f"{BUG_REPORT_SCRIPT}: report of {len(report)} bytes, over {BUG_REPORT_BYTES} kept"
            )
        else:
            files.append(HostFile("nvidia-bug-report.log.gz", "nvidia-bug-report.sh report", report))
