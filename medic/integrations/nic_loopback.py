"""perftest's `ib_write_bw` and `ib_write_lat` in loopback: reading what they print, and running
them on a node.

`parse_output` reads the first result table ib_write_bw prints (`#bytes  #iterations  BW peak[Gb/sec]
BW average[Gb/sec]  MsgRate[Mpps]`, or `[MB/sec]` without `--report_gbits`) into a `PerftestReport`,
its bandwidths in Gb/s whatever the unit printed. `parse_latency` reads the first table ib_write_lat
prints (`#bytes #iterations t_min[usec] t_max[usec] t_typical[usec]`, then, since perftest's 2016
releases, `t_avg`, `t_stdev` and the 99% and 99.9% percentiles) by its header's columns into a
`LatencyReport`. Output with no table, or a table without a result, is refused with the reason
(`PerftestOutputError`): a refusal is never a pass.

`IbWriteBwLoopback` implements `NicLoopbackTest` (bandwidth and latency): on the node, through the
runner DCGM uses (medic/integrations/dcgm/runner.py), it starts the tool's server on the device in the
background and its client against localhost, so the traffic leaves the NIC and comes back into it,
with a hard time limit. A node without the tool gives a run that says so (`missing_tool`), never a
result.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from medic.errors import PermanentError
from medic.integrations.dcgm.diagnostics import NODE_NAME
from medic.integrations.dcgm.runner import NodeRunner, runner_from_env
from medic.protocols import NicLatencyRun, NicLoopbackRun

TOOL = "ib_write_bw"
LAT_TOOL = "ib_write_lat"
# perftest's format_factor (src/perftest_parameters.c): MB/sec is 2^20 bytes a second, Gb/sec 10^9 bits.
_GBITS_PER_UNIT = {"Gb": 1.0, "MB": 0x100000 * 8 / 1e9}
_HEADER = re.compile(
    r"^\s*#bytes\s+#iterations\s+BW peak\[(?P<unit>Gb|MB)/sec\]\s+BW average\[(?P=unit)/sec\]\s+MsgRate\[Mpps\]"
)
_ROW = re.compile(
    r"^\s*(?P<bytes>\d+)\s+(?P<iters>\d+)\s+(?P<peak>[\d.]+)\s+(?P<avg>[\d.]+)\s+(?P<rate>[\d.]+)\s*$"
)
_DEVICE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
# Columns of ib_write_lat's table, by the header's names (src/perftest_parameters.h, RESULT_FMT_LAT).
_LAT_HEADER = re.compile(r"^\s*#bytes\s+#iterations\s+t_min\[usec\]")
_LAT_COLUMN = re.compile(r"#\w+|[\d.]+% percentile\[usec\]|\w+\[usec\]")
_LAT_NEEDED = ("#bytes", "#iterations", "t_min[usec]", "t_max[usec]", "t_typical[usec]")


def missing(tool: str) -> str:
    return f"medic: {tool} not installed"


MISSING = missing(TOOL)


def script(tool: str, options: str) -> str:
    """Run by `sh -c` on the node, with the device first ($1) and the tool's own values after it. The
    server's output goes to stderr so that stdout holds the client's table alone; the client waits a
    second for the server to listen, as perftest's own client does not retry. A client that fails
    leaves no server behind."""
    return f"""command -v {tool} >/dev/null 2>&1 || {{ echo "{missing(tool)}"; exit 127; }}
{tool} -d "$1" {options} 1>&2 &
server=$!
sleep 1
{tool} -d "$1" {options} localhost
status=$?
[ "$status" -eq 0 ] || kill "$server" 2>/dev/null
wait "$server"
exit "$status"
"""


SCRIPT = script(TOOL, '-s "$2" -D "$3" -F --report_gbits')
# No -s: perftest's 2-byte default, the latency of the link rather than of the copy. Not -D: under a
# duration ib_write_lat prints an average alone, no median or percentile.
LAT_SCRIPT = script(LAT_TOOL, '-n "$2" -F')


Report = TypeVar("Report", "PerftestReport", "LatencyReport")


class PerftestOutputError(PermanentError, ValueError):
    """Raised when text holds no ib_write_bw or ib_write_lat result; the message says what is missing."""


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


class LatencyRow(BaseModel):
    """One message size of ib_write_lat's table, in µs: half a round trip, as perftest prints it."""

    model_config = ConfigDict(frozen=True)

    size_bytes: int
    iterations: int
    min_us: float
    max_us: float
    typical_us: float  # the median
    avg_us: float | None = None  # this and the rest: None where perftest predates them (2016)
    stdev_us: float | None = None
    p99_us: float | None = None
    p999_us: float | None = None


class LatencyReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    columns: list[str]  # as the header names them
    rows: list[LatencyRow]

    @property
    def smallest(self) -> LatencyRow:
        return min(self.rows, key=lambda r: r.size_bytes)


_LAT_FIELDS = {
    "t_min[usec]": "min_us",
    "t_max[usec]": "max_us",
    "t_typical[usec]": "typical_us",
    "t_avg[usec]": "avg_us",
    "t_stdev[usec]": "stdev_us",
    "99% percentile[usec]": "p99_us",
    "99.9% percentile[usec]": "p999_us",
}


def parse_latency(text: str) -> LatencyReport:
    """ib_write_lat's first table (the client's in a loopback run), read by its header's column names:
    perftest releases differ in how many follow t_typical, and a column it does not know is refused
    rather than guessed."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _LAT_HEADER.match(line)), None)
    if start is None:
        raise PerftestOutputError("no latency table (`#bytes #iterations t_min[usec] ...`)")
    columns = _LAT_COLUMN.findall(lines[start])
    unknown = [c for c in columns if c not in _LAT_FIELDS and c not in _LAT_NEEDED]
    if unknown or columns[: len(_LAT_NEEDED)] != list(_LAT_NEEDED):
        raise PerftestOutputError(f"a latency table with columns not known: {' | '.join(columns)}")
    rows = []
    for line in lines[start + 1 :]:
        values = line.split()
        if not values or not values[0].isdigit():
            break
        if len(values) != len(columns):
            raise PerftestOutputError(f"a latency row that does not match its header: {line.strip()}")
        named = dict(zip(columns, values, strict=True))
        rows.append(
            LatencyRow(
                size_bytes=int(named["#bytes"]),
                iterations=int(named["#iterations"]),
                **{_LAT_FIELDS[c]: float(v) for c, v in named.items() if c in _LAT_FIELDS},
            )
        )
    if not rows:
        raise PerftestOutputError("a latency table with no result under its header")
    return LatencyReport(columns=columns, rows=rows)


class IbWriteBwLoopback:
    def __init__(self, runner: NodeRunner) -> None:
        self.runner = runner

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> IbWriteBwLoopback:
        """The runner DCGM uses (MEDIC_DCGM_RUNNER & co)."""
        return cls(runner_from_env(env))

    def command(self, device: str, size_bytes: int, duration_s: int) -> list[str]:
        return ["sh", "-c", SCRIPT, "sh", device, str(size_bytes), str(duration_s)]

    def latency_command(self, device: str, iterations: int) -> list[str]:
        return ["sh", "-c", LAT_SCRIPT, "sh", device, str(iterations)]

    def run(
        self, node: str, device: str, size_bytes: int, duration_s: int, timeout_s: float
    ) -> NicLoopbackRun:
        argv = self.command(device, size_bytes, duration_s)
        common, report = self._measure(node, device, TOOL, argv, timeout_s, parse_output)
        if report is None:
            return NicLoopbackRun(**common)
        largest = report.largest
        return NicLoopbackRun(
            **common,
            size_bytes=largest.size_bytes,
            bw_avg_gbps=largest.bw_avg_gbps,
            bw_peak_gbps=largest.bw_peak_gbps,
            msg_rate_mpps=largest.msg_rate_mpps,
        )

    def latency(self, node: str, device: str, iterations: int, timeout_s: float) -> NicLatencyRun:
        argv = self.latency_command(device, iterations)
        common, report = self._measure(node, device, LAT_TOOL, argv, timeout_s, parse_latency)
        if report is None:
            return NicLatencyRun(**common)
        row = report.smallest  # the only one: run without -a
        return NicLatencyRun(
            **common,
            size_bytes=row.size_bytes,
            iterations=row.iterations,
            typical_us=row.typical_us,
            p99_us=row.p99_us,
            p999_us=row.p999_us,
        )

    def _measure(
        self,
        node: str,
        device: str,
        tool: str,
        argv: list[str],
        timeout_s: float,
        parse: Callable[[str], Report],
    ) -> tuple[dict[str, Any], Report | None]:
        """The fields every run has, and what `parse` read from the client's table; no report where the
        fields say why (`error`) or that the tool is not on the node (`missing_tool`)."""
        started = datetime.now(UTC)
        common: dict[str, Any] = {"node": node, "device": device, "started_at": started}

        def done_with(**fields: Any) -> tuple[dict[str, Any], None]:
            return common | fields | {"finished_at": datetime.now(UTC)}, None

        if not NODE_NAME.fullmatch(node) or not _DEVICE.fullmatch(device):
            return done_with(
                error=f"{node!r} / {device!r}: not a node and RDMA device a command can be sent to"
            )
        done = self.runner.run(node, argv, timeout_s)
        output = done.stdout + (f"\n{done.stderr}" if done.stderr else "")
        common |= {"command": done.argv, "output": output}
        shown = f"{tool} loopback on {device}"
        if done.launch_error:
            return done_with(error=f"could not start {shown}: {done.launch_error}", output="")
        if done.timed_out:
            return done_with(error=f"{shown} did not finish within {timeout_s:g} s")
        if done.returncode == 127 and missing(tool) in done.stdout:
            return done_with(missing_tool=tool)
        try:
            report = parse(done.stdout)
        except PerftestOutputError as error:
            status = f" (exited {done.returncode})" if done.returncode else ""
            tail = " ".join(output.split())[-300:] or "no output"
            return done_with(error=f"{shown}: output unusable{status}: {error}: {tail}")
        if done.returncode:
            return done_with(error=f"{shown} exited {done.returncode} after its table")
        return common | {"finished_at": datetime.now(UTC)}, report
