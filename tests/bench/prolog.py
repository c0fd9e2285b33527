"""The Slurm prolog's overhead: how long the preflight holds a job's start.

`PYTHONPATH=tests python -m bench.prolog` prints a markdown section. The hook runs as on a GPU node, with NVML
answered by the shim of tests/nvml_shim (8 GPUs answering as the recorded H100 node of
tests/fixtures/nvml) and DCGM by the fake `dcgmi` of tests/fixtures/dcgm, which prints a saved
level-1 pass at once. So the figures are GPU Medic's own cost. On a real node the driver's time for
each NVML call comes on top, and so does DCGM level 1's own run, which the budget bounds: no DCGM
here, its part is the runner's share of the budget (MEDIC_PROLOG_BUDGET_S less 5 s to stop it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nvidia_smi import answer_with_shim, answers, fields, recorded
from nvml_support import ShimState, build_shim, shim_env

from bench import REPO_ROOT
from bench.report import Stats, ms, num, table
from medic.integrations.dcgm.runner import DEFAULT_TERM_GRACE_S
from medic.preflight import DEFAULT_BUDGET_S

READS = 200  # quick-check reads in one process
RUNS = 10  # prolog processes
DCGMI = REPO_ROOT / "tests" / "fixtures" / "dcgm"
# Times the quick checks as the prolog runs them, in a process whose NVML is the shim.
QUICK = f"""
import json, time
from medic.apps.hooks import PrologSettings, quick_checks
settings = PrologSettings(expected_gpus=8)
samples = []
for _ in range({READS}):
    began = time.perf_counter()
    verdict = quick_checks(settings)
    samples.append(time.perf_counter() - began)
    assert verdict.passed, verdict
print(json.dumps(samples))
"""


def _node(workdir: Path) -> tuple[dict[str, str], ShimState]:
    """A GPU node's environment, and its NVML: the shim answering as the recorded H100 node."""
    state = ShimState(workdir / "nvml-state")
    for index, gpu in enumerate(fields(recorded("h100-sxm-x8-565.57.01.txt"))):
        answer_with_shim(state, answers(gpu, index))
    dcgmi = workdir / "dcgmi"
    dcgmi.write_bytes((DCGMI / "fake_dcgmi.sh").read_bytes())
    dcgmi.chmod(0o755)
    env = shim_env(build_shim(workdir / "shim"), state) | {
        "MEDIC_DCGMI": str(dcgmi),
        "FAKE_DCGMI_MODE": "fixture",
        "FAKE_DCGMI_FIXTURE": str(DCGMI / "l1_pass.json"),
        "MEDIC_EVENTS_FILE": str(workdir / "events.jsonl"),
        "MEDIC_EXPECTED_GPUS": "8",
        "SLURMD_NODENAME": "bench-node",
        "SLURM_JOB_ID": "1",
    }
    return env, state


def _wall(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    began = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{argv} exited {done.returncode}:\n{done.stderr}")
    return wall, done.stderr


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="medic-bench-prolog-") as tmp:
        workdir = Path(tmp)
        env, state = _node(workdir)
        calls = workdir / "nvml-calls"
        quick = subprocess.run(
            [sys.executable, "-c", QUICK],
            env=env | {"MEDIC_NVML_SHIM_CALLS": str(calls)},
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        quick_s = json.loads(quick.stdout)
        prolog = [sys.executable, "-m", "medic.apps.hooks", "prolog"]
        passing = [_wall(prolog, env) for _ in range(RUNS)]
        imports = [_wall([sys.executable, "-c", "import medic.apps.hooks"], env)[0] for _ in range(RUNS)]
        # In process: from the first NVML call to the verdict, DCGM's (fake) run included.
        in_hook = [float(re.findall(r"preflight passed on \S+ in ([0-9.]+) s", err)[0]) for _, err in passing]
        state.gpu(3, remap_failure=1)
        failing = [_wall(prolog, env)[0] for _ in range(RUNS)]
        return {
            "quick": Stats.of(quick_s),
            "calls_per_read": int(calls.read_text()) / READS,
            "prolog": Stats.of([wall for wall, _ in passing]),
            "in_hook": Stats.of(in_hook),
            "imports": Stats.of(imports),
            "failing": Stats.of(failing),
        }


def section(results: dict[str, Any]) -> str:
    quick, prolog, failing = results["quick"], results["prolog"], results["failing"]
    dcgm_s = DEFAULT_BUDGET_S - DEFAULT_TERM_GRACE_S
    rows = [
        (
            f"quick checks, one NVML read of 8 GPUs judged (shim; {quick.n} reads)",
            ms(quick.median),
            ms(quick.p95),
        ),
        ("NVML calls per read", num(results["calls_per_read"]), ""),
        (
            "the preflight in the hook: quick checks + DCGM level 1 (fake, prints at once)",
            ms(results["in_hook"].median),
            ms(results["in_hook"].p95),
        ),
        (
            f"whole prolog, `python -m medic.apps.hooks prolog` start to exit, passing ({prolog.n} runs)",
            ms(prolog.median),
            ms(prolog.p95),
        ),
        (
            "of which Python's start and GPU Medic's imports",
            ms(results["imports"].median),
            ms(results["imports"].p95),
        ),
        (
            f"whole prolog, failing (a GPU's row remapping failed; fail open, no drain; {failing.n} runs)",
            ms(failing.median),
            ms(failing.p95),
        ),
        (
            "DCGM level 1 on a real node",
            "not measured (no DCGM here)",
            f"at most {dcgm_s:g} s: the budget ({DEFAULT_BUDGET_S:g} s) less {DEFAULT_TERM_GRACE_S:g} s to stop it",
        ),
    ]
    return "\n".join(
        [
            "## Slurm prolog overhead",
            "",
            "The prolog's preflight as slurmd starts it on a node (tests/bench/prolog.py): NVML from the shim, 8 GPUs",
            "answering as a recorded H100 node; the fake `dcgmi` printing a saved level-1 pass. These are GPU",
            "Medic's own costs: on a real node add the driver's time per NVML call and DCGM level 1's run",
            '(NVIDIA: "normally lasting seconds"), which the budget caps. A fail-closed prolog adds its drain:',
            "one `sinfo --json` and one `scontrol update` to slurmctld.",
            "",
            table(["measure", "median", "p95"], rows),
        ]
    )


if __name__ == "__main__":
    print(section(run()))
