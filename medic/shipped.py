"""What the package ships besides its code, found where it is installed, never in a checkout.

The wheel carries these as package data (pyproject.toml, [tool.setuptools.package-data]); in a
development checkout the same paths resolve through medic/'s links to the repository's folders
(docs/decisions/0012-one-import-namespace.md). Nothing at run time reads the repository itself: the
wheel check in tests/system/test_wheel.py runs the installed package from another directory.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
# Resolved against the package folder only: medic/policies is a link in a checkout, and its target
# must not stand in for the package in the paths we print.
SHIPPED_POLICY = PACKAGE / "policies" / "default.yaml"
ALERT_MAP = PACKAGE / "data" / "alertmanager.yaml"  # POST /v1/alertmanager: alerts to fault kinds
# Real torch.profiler traces of the reference job (SOURCES.md there): `medic demo`'s job answers
# GPU Medic's profile requests with them.
DEMO_PROFILES = PACKAGE / "data" / "profiles"
TRAIN_SCRIPT = PACKAGE / "training" / "train.py"
SLURM_HOOKS = PACKAGE / "slurm_hooks"
SYSTEMD_UNITS = PACKAGE / "systemd"
