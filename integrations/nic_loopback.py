"""perftest's `ib_write_bw` in loopback: reading what it prints, and running it on a node.

`parse_output` reads the first result table ib_write_bw prints (`#bytes  #iterations  BW peak[Gb/sec]
BW average[Gb/sec]  MsgRate[Mpps]`, or `[MB/sec]` without `--report_gbits`) into a `PerftestReport`,
its bandwidths in Gb/s whatever the unit printed. Output with no table, or a table without a result,
is refused with the reason (`PerftestOutputError`): a refusal is never a pass.

`IbWriteBwLoopback` implements `NicLoopbackTest`: on the node, through the runner DCGM uses
(integrations/dcgm/runner.py), it starts the ib_write_bw server on the device in the background and
its client against localhost, so the traffic leaves the NIC and comes back into it, with a hard time
limit. A node without ib_write_bw gives a run that says so (`missing_tool`), never a result.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict

from integrations.dcgm.diagnostics import NODE_NAME
from integrations.dcgm.runner import NodeRunner, runner_from_env
from medic.errors import PermanentError
from medic.protocols import NicLoopbackRun

TOOL = "ib_write_bw"
# perftest's format_factor (src/perftest_parameters.c): MB/sec is 2^20 bytes a second, Gb/sec 10^9 bits.
_GBITS_PER_UNIT = {"Gb": 1.0, "MB": 0x100000 * 8 / 1e9}
_HEADER = re.compile(
    r"^\s*#bytes\s+#iterations\s+BW peak\[(?P<unit>Gb|MB)/sec\]\s+BW average\[(?P=unit)/sec\]\s+MsgRate\[Mpps\]"
)
_ROW = re.compile(
    r"^\s*(?P<bytes>\d+)\s+(?P<iters>\d+)\s+(?P<peak>[\d.]+)\s+(?P<avg>[\d.]+)\s+(?P<rate>[\d.]+)\s*$"
)
_DEVICE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MISSING = f"medic: {TOOL} not installed"
# Run by `sh -c` on the node, with the device, size and duration as $1, $2, $3. The server's output
# goes to stderr so that stdout holds the client's table alone; the client waits a second for the
# server to listen, as perftest's own client does not retry. A client that fails leaves no server behind.
SCRIPT = f"""command -v {TOOL} >/dev/null 2>&1 || {{ echo "{MISSING}"; exit 127; }}
{TOOL} -d "$1" -s "$2" -D "$3" -F --report_gbits 1>&2 &
server=$!
sleep 1
{TOOL} -d "$1" -s "$2" -D "$3" -F --report_gbits localhost
status=$?
[ "$status" -eq 0 ] || kill "$server" 2>/dev/null
wait "$server"
exit "$status"
"""


class PerftestOutputError(PermanentError, ValueError):
    """Raised when text holds no ib_write_bw result; the message says what is missing."""


class PerftestRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    size_bytes: int
    iterations: int
    bw_peak_gbps: float
    bw_avg_gbps: float
    msg_rate_mpps: float


class PerftestReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    unit: str  # as printed: Gb or MB (per second)
    rows: list[PerftestRow]

    @property
    def largest(self) -> PerftestRow:
        return max(self.rows, key=lambda r: r.size_bytes)


def parse_output(text: str) -> PerftestReport:
    """The first result table: the client's in a loopback run, where the server's follows it."""
    lines = text.splitlines()
    found = next(((i, m) for i, line in enumerate(lines) if (m := _HEADER.match(line))), None)
    if found is None:
        raise PerftestOutputError("no result table (`#bytes #iterations BW peak ...`)")
    start, header = found
    unit = header["unit"]
    factor = _GBITS_PER_UNIT[unit]
    rows = []
    for line in lines[start + 1 :]:
        row = _ROW.match(line)
        if row is None:
            break
        rows.append(
            PerftestRow(
                size_bytes=int(row["bytes"]),
                iterations=int(row["iters"]),
                bw_peak_gbps=round(float(row["peak"]) * factor, 3),
                bw_avg_gbps=round(float(row["avg"]) * factor, 3),
                msg_rate_mpps=float(row["rate"]),
            )
        )
    if not rows:
        raise PerftestOutputError("a result table with no result under its header")
    return PerftestReport(unit=unit, rows=rows)


class IbWriteBwLoopback:
    def __init__(self, runner: NodeRunner) -> None:
        self.runner = runner

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> IbWriteBwLoopback:
        """The runner DCGM uses (MEDIC_DCGM_RUNNER & co)."""
        return cls(runner_from_env(env))

    def command(self, device: str, size_bytes: int, duration_s: int) -> list[str]:
        return ["sh", "-c", SCRIPT, "sh", device, str(size_bytes), str(duration_s)]

    def run(
        self, node: str, device: str, size_bytes: int, duration_s: int, timeout_s: float
    ) -> NicLoopbackRun:
        started = datetime.now(UTC)

        def failed(why: str, argv: tuple[str, ...] = (), output: str = "") -> NicLoopbackRun:
            return NicLoopbackRun(
                node,
                device,
                argv,
                error=why,
                output=output,
                started_at=started,
                finished_at=datetime.now(UTC),
            )

        if not NODE_NAME.fullmatch(node) or not _DEVICE.fullmatch(device):
            return failed(f"{node!r} / {device!r}: not a node and RDMA device a command can be sent to")
        done = self.runner.run(node, self.command(device, size_bytes, duration_s), timeout_s)
        output = done.stdout + (f"\n{done.stderr}" if done.stderr else "")
        shown = f"{TOOL} loopback on {device}"
        if done.launch_error:
            return failed(f"could not start {shown}: {done.launch_error}", done.argv)
        if done.timed_out:
            return failed(f"{shown} did not finish within {timeout_s:g} s", done.argv, output)
        if done.returncode == 127 and MISSING in done.stdout:
            return NicLoopbackRun(
                node,
                device,
                done.argv,
                missing_tool=TOOL,
                output=output,
                started_at=started,
                finished_at=datetime.now(UTC),
            )
        try:
            report = parse_output(done.stdout)
        except PerftestOutputError as error:
            status = f" (exited {done.returncode})" if done.returncode else ""
            tail = " ".join(output.split())[-300:] or "no output"
            return failed(f"{shown}: output unusable{status}: {error}: {tail}", done.argv, output)
        if done.returncode:
            return failed(f"{shown} exited {done.returncode} after its table", done.argv, output)
        largest = report.largest
        return NicLoopbackRun(
            node,
            device,
            done.argv,
            size_bytes=largest.size_bytes,
            bw_avg_gbps=largest.bw_avg_gbps,
            bw_peak_gbps=largest.bw_peak_gbps,
            msg_rate_mpps=largest.msg_rate_mpps,
            output=output,
            started_at=started,
            finished_at=datetime.now(UTC),
        )
