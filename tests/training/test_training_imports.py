"""A training process imports the standard library and torch only: a restart pays for nothing else.

Each check imports the job's modules in a fresh interpreter, from medic/training as a job
runs them, with GPU Medic installed in that interpreter: only the job's own imports keep it out.
tests/bench/resume.py measures what the imports cost.
"""

from __future__ import annotations

import json
import subprocess
import sys

from torchrun_support import TRAINING_DIR

# The training side ships in the package as medic.training; importing it runs medic/__init__.py (a
# version string) and nothing else of GPU Medic.
JOB_PACKAGES = {"medic", "medic.training"}
NOT_FOR_TRAINING = {"pydantic", "yaml", "prefect", "sqlalchemy"}


def imported_by(module: str) -> set[str]:
    """The modules that importing `module` (and running nothing) adds: GPU Medic's by full name,
    everything else by its top-level name."""
    code = (
        f"import json, sys; before = set(sys.modules); import {module}; "
        "print(json.dumps(sorted({m if m.startswith('medic') else m.split('.')[0] "
        "for m in set(sys.modules) - before})))"
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


def ours(imported: set[str]) -> set[str]:
    return {m for m in imported if m.startswith("medic")} - JOB_PACKAGES


def test_the_hooks_and_the_checkpoint_layout_need_only_the_standard_library() -> None:
    for module in ("medic.training.medic_hooks", "medic.training.checkpoint_layout"):
        imported = imported_by(module)
        outside = {m for m in imported if not m.startswith("medic")} - sys.stdlib_module_names
        assert not outside, f"{module} imports {sorted(outside)}"
        assert ours(imported) == {module}, f"{module} imports {sorted(ours(imported))}"


def test_the_training_job_imports_no_gpu_medic_and_no_pydantic() -> None:
    imported = imported_by("medic.training.train")
    assert "torch" in imported
    assert ours(imported) <= {
        f"medic.training.{m}" for m in ("train", "medic_hooks", "checkpoint_layout", "profiling")
    }
    assert not imported & NOT_FOR_TRAINING
