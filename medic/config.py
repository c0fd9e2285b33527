"""Where GPU Medic keeps its data and which backends it talks to (all overridable by env vars).

| variable              | default                                   |
| --------------------- | ----------------------------------------- |
| MEDIC_HOME            | ~/.medic (the data directory)             |
| MEDIC_DATABASE_URL    | sqlite:///$MEDIC_HOME/medic.db            |
| MEDIC_POLICY          | policies/default.yaml                     |
| MEDIC_SCHEDULER       | sim                                       |
| MEDIC_PROVIDER        | sim                                       |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Settings:
    home: Path
    database_url: str
    policy_path: Path
    scheduler: str
    provider: str


def _default_policy() -> Path:
    local = Path("policies/default.yaml")
    return local if local.is_file() else REPO_ROOT / "policies" / "default.yaml"


def load_settings(env: dict[str, str] | None = None) -> Settings:
    env = dict(os.environ) if env is None else env
    home = Path(env.get("MEDIC_HOME") or Path.home() / ".medic").expanduser()
    return Settings(
        home=home,
        database_url=env.get("MEDIC_DATABASE_URL") or f"sqlite:///{home / 'medic.db'}",
        policy_path=Path(env["MEDIC_POLICY"]) if env.get("MEDIC_POLICY") else _default_policy(),
        scheduler=env.get("MEDIC_SCHEDULER", "sim"),
        provider=env.get("MEDIC_PROVIDER", "sim"),
    )
