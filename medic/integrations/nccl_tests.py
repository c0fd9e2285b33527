"""NVIDIA's nccl-tests `all_reduce_perf`: reading what it prints, and running it across nodes.

`parse_output` reads the text all_reduce_perf prints into an `NcclTestsReport`: the run's header
(`# nThread 1 nGpus 1 minBytes 8 maxBytes ...`), one line per rank (`#  Rank  0 Group  0 Pid 6899 on
host device  0 [0000:04:00] NVIDIA H100 80GB HBM3`), the out-of-place / in-place table and the footer
(`# Out of bounds values : 0 OK`, `# Avg bus bandwidth : 70.742`). The columns are found by their names
in the table's header, so every layout since nccl-tests 2.0 (2019) is read: before 2.13 there is no
`root` column and the correctness column is `error`, the largest deviation seen (`0e+00`, `N/A`
without validation); from 2.13 it is `#wrong`, a count of wrong elements. Rank lines gained `Group`
in 2.13.4 and a PCI domain (`[0000:04:00]` for `[0x04]`) in 2.16; 2.17 frames the run with
`# Collective test starting/concluded`, 2.18 adds a `# nccl-tests version` line. Open MPI's `--tag-output` prefixes
(`[1,0]<stdout>:`) and the library's own log lines (`host:pid:tid [0] NCCL INFO ...`) are passed over.

Output that cannot be read as a complete run is refused with the reason (`NcclTestsOutputError`):
no header, a header per process (a binary built without MPI, each rank alone), no table, a result
line that does not fit the table, the footer missing (cut short). A refusal is never a pass.

`NcclTestsAllReduce` implements `AllReduceTest`: it builds the `mpirun` or `srun` command that starts
one rank per GPU on the nodes (`all_reduce_perf -b MIN -e MAX -f FACTOR -g 1 -c 1`), runs it with a
hard time limit, and reads its output into an `AllReduceRun` (docs/deep-checks.md).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

from medic.errors import PermanentError
from medic.integrations.dcgm.diagnostics import NODE_NAME
from medic.integrations.dcgm.runner import DEFAULT_TERM_GRACE_S, SRUN_IMMEDIATE_S, run_process
from medic.protocols import AllReduceRun, AllReduceSpec


class NcclTestsOutputError(PermanentError, ValueError):
    """Raised when text is not a complete all_reduce_perf run; the message says what is missing."""


# Open MPI's --tag-output puts the job and rank of the process that printed each line first.
_TAG = re.compile(r"^\[\d+,\d+\]<(?:stdout|stderr)>:")
_HEADER = re.compile(
    r"^#?\s*nThread (?P<threads>\d+) nGpus (?P<gpus>\d+) minBytes (?P<min>\d+) maxBytes (?P<max>\d+) "
    r"step: (?P<step>\d+)\((?P<kind>factor|bytes)\) warmup iters: (?P<warmup>\d+) iters: (?P<iters>\d+)"
    r"(?: agg iters: \d+)? validation: (?P<validation>\d+)"
)
_VERSION = re.compile(r"^#\s*nccl-tests version (?P<version>\S+)")
_STARTING = re.compile(r"^#\s*Collective test starting: (?P<test>\S+)")
_RANK = re.compile(
    r"^#\s*Rank\s+(?P<rank>\d+)\s+(?:Group\s+(?P<group>\d+)\s+)?(?:Pid\s+(?P<pid>\d+)\s+)?on\s+(?P<host>\S+)"
    r"\s+device\s+(?P<device>\d+)\s+\[(?P<bus>[^\]]*)\]\s*(?P<name>.*?)\s*$"
)
_OUT_OF_BOUNDS = re.compile(r"^#?\s*Out of bounds values\s*:\s*(?P<count>\d+)\b")
_AVG_BUSBW = re.compile(r"^#?\s*Avg bus bandwidth\s*:\s*(?P<value>\S+)")
_REDUCED = re.compile(r"^#\s*Reducing maxBytes to (?P<max>\d+)")
# What nccl-tests prints when a rank fails (its CUDACHECK, NCCLCHECK and TESTCHECK macros, the
# watchdog of -T) and, at the end, NCCL's last error.
_FAILURE = re.compile(r"\bTest (?:CUDA failure|NCCL failure|failure|timeout)\b|^#\s*error:")

SHOWN_FAILURES = 4
_LEADING = ("size", "count", "type", "redop", "root")
_TIMES = ("time", "cputime")
_WRONG = ("#wrong", "error")


class Device(BaseModel):
    model_config = ConfigDict(frozen=True)

    rank: int
    group: int | None = None  # from 2.13
    pid: int | None = None
    host: str
    device: int
    bus_id: str  # `0x04` before 2.16, `0000:04:00` from it
    name: str


class Measure(BaseModel):
    """One half of a result line: out-of-place or in-place."""

    model_config = ConfigDict(frozen=True)

    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: float | None  # wrong elements (`#wrong`) or the largest deviation (`error`); None: N/A


class Row(BaseModel):
    model_config = ConfigDict(frozen=True)

    size: int
    count: int
    type: str
    redop: str | None = None
    root: int | None = None
    out_of_place: Measure
    in_place: Measure


class NcclTestsReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    test: str | None = None  # `all_reduce_perf` (from 2.17)
    version: str | None = None  # nccl-tests' own (from 2.18)
    threads: int
    gpus_per_thread: int
    min_bytes: int
    max_bytes: int
    step: int
    step_kind: Literal["factor", "bytes"]
    warmup_iters: int
    iters: int
    validation: bool
    devices: list[Device]
    wrong_column: Literal["#wrong", "error"]
    rows: list[Row]
    out_of_bounds: int
    avg_busbw_gbps: float
    reduced_max_bytes: int | None = None  # nccl-tests lowered maxBytes to fit the GPUs' memory
    failures: list[str] = []

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(d.host for d in self.devices))

    @property
    def largest_bytes(self) -> int:
        return max(r.size for r in self.rows)

    @property
    def busbw_at_largest(self) -> float:
        """The lower of the out-of-place and in-place bus bandwidths at the largest size."""
        return min(
            min(r.out_of_place.busbw_gbps, r.in_place.busbw_gbps)
            for r in self.rows
            if r.size == self.largest_bytes
        )

    def wrong_elements(self) -> list[str]:
        """Where elements were wrong: `1048576 B out-of-place: 96`. Only `#wrong` counts them; the older
        `error` column is a deviation that nccl-tests judges itself, in its out-of-bounds count."""
        if self.wrong_column != "#wrong":
            return []
        return [
            f"{r.size} B {where}: {m.wrong:g}"
            for r in self.rows
            for where, m in (("out-of-place", r.out_of_place), ("in-place", r.in_place))
            if m.wrong
        ]


def _number(token: str, what: str, line: str) -> float:
    try:
        return float(token)
    except ValueError:
        raise NcclTestsOutputError(
            f"{what} {token!r} is not a number in result line {line.strip()!r}"
        ) from None


def _integer(token: str, what: str, line: str) -> int:
    if not re.fullmatch(r"-?\d+", token):
        raise NcclTestsOutputError(f"{what} {token!r} is not an integer in result line {line.strip()!r}")
    return int(token)


class _Columns:
    """The table's header line: the leading columns, then one perf group per half."""

    def __init__(self, names: list[str]) -> None:
        starts = [i for i, name in enumerate(names) if name in _TIMES]
        if len(starts) != 2:
            raise NcclTestsOutputError(f"table header without an out-of-place and an in-place time: {names}")
        self.leading = names[: starts[0]]
        half = names[starts[0] : starts[1]]
        if names[starts[1] :] != half:
            raise NcclTestsOutputError(f"table header with columns this parser does not know: {names}")
        unknown = [n for n in self.leading if n not in _LEADING]
        wrong = [n for n in half if n in _WRONG]
        if unknown or not {"size", "count", "type"} <= set(self.leading):
            raise NcclTestsOutputError(
                f"table header with leading columns this parser does not know: {names}"
            )
        if not {"algbw", "busbw"} <= set(half) or len(wrong) != 1:
            raise NcclTestsOutputError(f"table header without algbw, busbw and #wrong or error: {names}")
        self.half = half
        self.wrong: Literal["#wrong", "error"] = "#wrong" if wrong[0] == "#wrong" else "error"
        self.width = len(names)

    def row(self, tokens: list[str], line: str) -> Row:
        if len(tokens) != self.width:
            raise NcclTestsOutputError(
                f"result line with {len(tokens)} columns where the table has {self.width} "
                f"(cut short?): {line.strip()!r}"
            )
        lead = dict(zip(self.leading, tokens, strict=False))
        n = len(self.leading)
        halves = [
            dict(zip(self.half, tokens[n + k * len(self.half) : n + (k + 1) * len(self.half)], strict=True))
            for k in (0, 1)
        ]
        return Row(
            size=_integer(lead["size"], "size", line),
            count=_integer(lead["count"], "count", line),
            type=lead["type"],
            redop=lead.get("redop"),
            root=_integer(lead["root"], "root", line) if "root" in lead else None,
            out_of_place=self._measure(halves[0], line),
            in_place=self._measure(halves[1], line),
        )

    def _measure(self, values: dict[str, str], line: str) -> Measure:
        time = next(values[t] for t in _TIMES if t in values)
        wrong = values[self.wrong]
        return Measure(
            time_us=_number(time, "time", line),
            algbw_gbps=_number(values["algbw"], "algbw", line),
            busbw_gbps=_number(values["busbw"], "busbw", line),
            wrong=None if wrong == "N/A" else _number(wrong, self.wrong, line),
        )


def _said(failures: list[str]) -> str:
    """Each failure once (every rank prints the same), the first few of them."""
    distinct = list(dict.fromkeys(failures))
    more = f" | and {len(distinct) - SHOWN_FAILURES} more" if len(distinct) > SHOWN_FAILURES else ""
    return " | ".join(distinct[:SHOWN_FAILURES]) + more


def _is_result(tokens: list[str]) -> bool:
    """A result line starts with its size and count; a log line (`host:pid:tid [0] NCCL INFO`) does not."""
    return len(tokens) >= 2 and tokens[0].isdigit() and tokens[1].isdigit()


def parse_output(text: str) -> NcclTestsReport:
    """The run `text` shows; `NcclTestsOutputError` with the reason when it is not a complete one."""
    headers: list[re.Match[str]] = []
    devices: list[Device] = []
    columns: _Columns | None = None
    rows: list[Row] = []
    failures: list[str] = []
    version = test = None
    out_of_bounds: int | None = None
    avg: float | None = None
    reduced: int | None = None
    for raw in text.splitlines():
        line = _TAG.sub("", raw).strip()
        if _FAILURE.search(line):
            failures.append(line)
        elif m := _HEADER.match(line):
            headers.append(m)
        elif m := _VERSION.match(line):
            version = m["version"]
        elif m := _STARTING.match(line):
            test = m["test"]
        elif m := _RANK.match(line):
            devices.append(
                Device(
                    rank=int(m["rank"]),
                    group=None if m["group"] is None else int(m["group"]),
                    pid=None if m["pid"] is None else int(m["pid"]),
                    host=m["host"],
                    device=int(m["device"]),
                    bus_id=m["bus"],
                    name=m["name"],
                )
            )
        elif m := _OUT_OF_BOUNDS.match(line):
            out_of_bounds = int(m["count"])
        elif m := _AVG_BUSBW.match(line):
            avg = _number(m["value"], "Avg bus bandwidth", line)
        elif m := _REDUCED.match(line):
            reduced = int(m["max"])
        elif line.startswith("#") and "busbw" in line.split():
            columns = _Columns(line.lstrip("#").split())
        elif columns is not None and out_of_bounds is None and _is_result(tokens := line.split()):
            rows.append(columns.row(tokens, line))
    failed = f"; it reported: {_said(failures)}" if failures else ""
    if not headers:
        raise NcclTestsOutputError(f"no nccl-tests header (`# nThread ... nGpus ...`){failed}")
    if len(headers) > 1:
        raise NcclTestsOutputError(
            f"{len(headers)} runs in one output, each with its own header: every process ran alone "
            "(is all_reduce_perf built with MPI=1?)"
        )
    if test is not None and not test.startswith("all_reduce_perf"):
        raise NcclTestsOutputError(f"output of {test}, not of all_reduce_perf")
    if not devices:
        raise NcclTestsOutputError(f"no rank lines (`#  Rank  0 ... on HOST device ...`){failed}")
    ranks = sorted(d.rank for d in devices)
    if ranks != list(range(len(devices))):
        raise NcclTestsOutputError(f"rank lines are not ranks 0 to {len(devices) - 1}: {ranks}")
    if columns is None or not rows:
        raise NcclTestsOutputError(f"the run ended before its first result{failed}")
    if out_of_bounds is None or avg is None:
        missing = "`Out of bounds values`" if out_of_bounds is None else "`Avg bus bandwidth`"
        raise NcclTestsOutputError(
            f"cut short after {len(rows)} results, up to {rows[-1].size} B: no {missing} line{failed}"
        )
    header = headers[0]
    return NcclTestsReport(
        test=test,
        version=version,
        threads=int(header["threads"]),
        gpus_per_thread=int(header["gpus"]),
        min_bytes=int(header["min"]),
        max_bytes=int(header["max"]),
        step=int(header["step"]),
        step_kind=header["kind"],
        warmup_iters=int(header["warmup"]),
        iters=int(header["iters"]),
        validation=header["validation"] != "0",
        devices=devices,
        wrong_column=columns.wrong,
        rows=rows,
        out_of_bounds=out_of_bounds,
        avg_busbw_gbps=avg,
        reduced_max_bytes=reduced,
        failures=failures,
    )


LAUNCHERS = ("mpirun", "srun")


class NcclTestsConfigError(PermanentError, ValueError):
    """Raised when MEDIC_NCCL_LAUNCHER names a launcher that is not supported."""


class NcclTestsAllReduce:
    """`AllReduceTest` over all_reduce_perf, started by Open MPI's mpirun (over ssh: it reaches drained
    nodes) or by srun (a Slurm job step: only where Slurm allocates the nodes)."""

    def __init__(
        self,
        launcher: str = "mpirun",
        launcher_args: tuple[str, ...] = (),
        binary: str = "all_reduce_perf",
        term_grace_s: float = DEFAULT_TERM_GRACE_S,
    ) -> None:
        if launcher not in LAUNCHERS:
            raise NcclTestsConfigError(
                f"MEDIC_NCCL_LAUNCHER={launcher!r}: choose one of {', '.join(LAUNCHERS)}"
            )
        self.launcher = launcher
        self.launcher_args = launcher_args
        self.binary = binary
        self.term_grace_s = term_grace_s

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NcclTestsAllReduce:
        """MEDIC_NCCL_LAUNCHER (mpirun | srun), MEDIC_NCCL_LAUNCHER_ARGS (shell-quoted), MEDIC_ALL_REDUCE_PERF."""
        return cls(
            env.get("MEDIC_NCCL_LAUNCHER") or "mpirun",
            tuple(shlex.split(env.get("MEDIC_NCCL_LAUNCHER_ARGS", ""))),
            env.get("MEDIC_ALL_REDUCE_PERF") or "all_reduce_perf",
        )

    def command(self, spec: AllReduceSpec) -> list[str]:
        # One rank per GPU (-g 1), every result checked (-c 1): a count of wrong elements, not N/A.
        test = [
            self.binary,
            "-b",
            str(spec.min_bytes),
            "-e",
            str(spec.max_bytes),
            "-f",
            str(spec.step_factor),
            "-g",
            "1",
            "-c",
            "1",
        ]
        per_node = spec.gpus_per_node
        if self.launcher == "srun":
            return [
                "srun",
                f"--nodes={len(spec.nodes)}",
                f"--nodelist={','.join(spec.nodes)}",
                f"--ntasks-per-node={per_node}",
                f"--immediate={SRUN_IMMEDIATE_S}",
                "--quiet",
                *self.launcher_args,
                *test,
            ]
        return [
            "mpirun",
            "-np",
            str(len(spec.nodes) * per_node),
            "--host",
            ",".join(f"{node}:{per_node}" for node in spec.nodes),
            "--bind-to",
            "none",
            *self.launcher_args,
            *test,
        ]

    def run(self, spec: AllReduceSpec, timeout_s: float) -> AllReduceRun:
        started = datetime.now(UTC)

        def failed(why: str, argv: tuple[str, ...] = (), output: str = "") -> AllReduceRun:
            return AllReduceRun(
                spec, argv, error=why, output=output, started_at=started, finished_at=datetime.now(UTC)
            )

        bad = [n for n in spec.nodes if not NODE_NAME.fullmatch(n)]
        if bad or not spec.nodes or spec.gpus_per_node < 1:
            return failed(
                f"not an all-reduce that can be started: nodes {list(spec.nodes)}, {spec.gpus_per_node} GPUs each"
            )
        done = run_process(self.command(spec), timeout_s, term_grace_s=self.term_grace_s)
        command = shlex.join(done.argv)
        output = done.stdout + (f"\n{done.stderr}" if done.stderr else "")
        if done.launch_error:
            return failed(f"could not start `{command}`: {done.launch_error}", done.argv)
        if done.timed_out:
            return failed(
                f"the all-reduce did not finish within {timeout_s:g} s; `{command}` and its process group "
                "were killed",
                done.argv,
                output,
            )
        try:
            report = parse_output(output)
        except NcclTestsOutputError as error:
            status = f" (`{self.launcher}` exited {done.returncode})" if done.returncode else ""
            return failed(f"all_reduce_perf output unusable{status}: {error}", done.argv, output)
        if not report.validation:
            return failed("all_reduce_perf did not check its results (validation: 0)", done.argv, output)
        failures = list(report.failures)
        if done.returncode:
            # nccl-tests exits nonzero when results were wrong; otherwise a rank died after the table.
            failures.append(f"`{self.launcher}` exited {done.returncode}")
        return AllReduceRun(
            spec,
            done.argv,
            ranks=len(report.devices),
            hosts=tuple(report.hosts),
            largest_bytes=report.largest_bytes,
            busbw_gbps=report.busbw_at_largest,
            avg_busbw_gbps=report.avg_busbw_gbps,
            out_of_bounds=report.out_of_bounds,
            wrong=tuple(report.wrong_elements()),
            failures=tuple(failures),
            version=report.version,
            output=output,
            started_at=started,
            finished_at=datetime.now(UTC),
        )
