"""`Diagnostics` backed by the real `dcgmi diag` (docs/dcgm.md).

Every way a run can go wrong (dcgmi missing, nv-hostengine down, a hang, output that is not
JSON, a DCGM runtime error, partial results, a test of the level skipped or not run) becomes a
DiagnosticResult with result "error" and a detail saying which: the flow escalates on "error"
instead of guessing about the GPU, and verification never reintegrates a node on it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from datetime import UTC, datetime

from medic.integrations.dcgm.parse import DcgmOutputError, DiagReport, Finding, Verdict, parse_report
from medic.integrations.dcgm.runner import Completed, NodeRunner, runner_from_env
from medic.protocols import DiagnosticResult

LEVELS = range(1, 5)
# Scheduler node names: no spaces, commas or brackets (a Slurm node list would reach many nodes).
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
# What dcgmi prints (on stdout) when it cannot reach nv-hostengine.
HOSTENGINE_DOWN = ("unable to establish a connection", "unable to connect to host engine")
TAIL_CHARS = 300


class DcgmDiagnostics:
    def __init__(self, runner: NodeRunner, dcgmi: str = "dcgmi") -> None:
        self.runner = runner
        self.dcgmi = dcgmi

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DcgmDiagnostics:
        """The runner from MEDIC_DCGM_RUNNER & co (runner_from_env); MEDIC_DCGMI: dcgmi's path on the nodes."""
        return cls(runner_from_env(env), dcgmi=env.get("MEDIC_DCGMI") or "dcgmi")

    def command(self, level: int) -> list[str]:
        return [self.dcgmi, "diag", "-r", str(level), "-j"]

    def run(self, node: str, level: int, timeout_s: float) -> DiagnosticResult:
        started = datetime.now(UTC)

        def result(
            verdict: str, detail: str, error_ids: tuple[str, ...] = (), worst: str | None = None
        ) -> DiagnosticResult:
            return DiagnosticResult(
                node, level, verdict, error_ids, detail, started, datetime.now(UTC), worst
            )

        if level not in LEVELS:
            return result("error", f"DCGM level {level} does not exist (1-4)")
        if not NODE_NAME.fullmatch(node):
            return result("error", f"{node!r} is not a node name dcgmi can be sent to")
        done = self.runner.run(node, self.command(level), timeout_s)
        problem = _run_problem(done, node, level, timeout_s)
        if problem:
            return result("error", problem)
        try:
            report = parse_report(done.stdout)
        except DcgmOutputError as error:
            return result("error", f"DCGM level {level} on {node}: dcgmi output unusable ({error})")
        if report.verdict is Verdict.ERROR:
            return result("error", f"DCGM level {level} on {node}: {report.reason}")
        if report.level is not None and report.level < level:
            ran = ", ".join(t.name for t in report.tests)
            return result(
                "error",
                f"DCGM level {level} on {node}: partial results, only level-{report.level} tests ran ({ran})",
            )
        verdict, reason = report.judge(level)
        if verdict is Verdict.INCOMPLETE:
            # Some GPU was not tested at this level: no verdict, never a pass (nor a reintegration).
            return result("error", f"DCGM level {level} on {node}: incomplete, {reason}")
        return result(
            verdict.value, _describe(report, node, level, verdict), report.error_ids, report.worst_severity
        )


def _tail(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= TAIL_CHARS else "…" + text[-TAIL_CHARS:]


def _run_problem(done: Completed, node: str, level: int, timeout_s: float) -> str | None:
    """Why the run gave no usable output, or None when stdout is worth parsing."""
    command = shlex.join(done.argv)
    if done.launch_error:
        return f"could not start `{command}`: {done.launch_error}"
    if done.timed_out:
        ending = (
            "were killed"
            if done.returncode is not None
            else "were killed but did not exit (stuck in the kernel?)"
        )
        return f"DCGM level {level} on {node} did not finish within {timeout_s:g} s; `{command}` and its process group {ending}"
    if done.stdout.lstrip().startswith("{"):
        return None  # dcgmi exits nonzero when tests fail: its JSON, not its exit code, has the verdict
    output = _tail(f"{done.stdout}\n{done.stderr}")
    if any(marker in output.lower() for marker in HOSTENGINE_DOWN):
        return f"nv-hostengine is not reachable on {node} (is the nvidia-dcgm service running?): {output}"
    if done.returncode == 127:
        return f"dcgmi not found on {node} (`{command}` exited 127): {output}"
    if done.returncode != 0:
        return f"`{command}` exited {done.returncode}: {output or 'no output'}"
    return None


def _describe(report: DiagReport, node: str, level: int, verdict: Verdict) -> str:
    head = f"DCGM level {level} {verdict.value} on {node}"
    if not report.failing:
        gpus = sum(1 for e in report.entities() if e.group == "GPU")
        return f"{head}: {len(report.tests)} tests on {gpus} GPUs ({', '.join(t.name for t in report.tests)})"
    where: dict[Finding, list[str]] = {}
    for entity in report.entities():
        for finding in entity.findings:
            where.setdefault(finding, []).append(f"{entity.group} {entity.entity_id}")
    return f"{head}: " + "; ".join(
        f"{', '.join(where.get(f, ['node']))} {f.test} {f.name} ({f.severity.value}): {f.message}"
        for f in report.failing
    )
