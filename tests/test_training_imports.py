"""A training process imports the standard library and torch only: a restart pays for nothing else.

Each check imports the job's modules in a fresh interpreter, from deployments/training as a job
runs them, with GPU Medic installed in that interpreter: only the job's own imports keep it out.
bench/resume.py measures what the imports cost.
"""

from __future__ import annotations

import json
import subprocess
import sys

from torchrun_support import TRAINING_DIR

JOB_MODULES = {"train", "medic_hooks", "checkpoint_layout", "profiling"}
GPU_MEDIC = {"medic", "integrations", "tasks", "flows", "apps", "pydantic"}


def imported_by(module: str) -> set[str]:
    """The top-level names of the modules that importing `module` (and running nothing) adds."""
    code = (
        f"import json, sys; before = set(sys.modules); import {module}; "
        "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=TRAINING_DIR,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(json.loads(done.stdout))


def test_the_hooks_and_the_checkpoint_layout_need_only_the_standard_library() -> None:
    for module in ("medic_hooks", "checkpoint_layout"):
        outside = imported_by(module) - sys.stdlib_module_names - JOB_MODULES
        assert not outside, f"{module} imports {sorted(outside)}"


def test_the_training_job_imports_no_gpu_medic_and_no_pydantic() -> None:
    imported = imported_by("train")
    assert "torch" in imported
    assert not imported & GPU_MEDIC
