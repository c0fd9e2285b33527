"""Where GPU Medic keeps its data and which backends it talks to.

Settings come from one YAML file per deployment (MEDIC_CONFIG, default $MEDIC_HOME/config.yaml,
optional) naming the backends per cluster, and from environment variables, which win:

| variable              | default                                   |
| --------------------- | ----------------------------------------- |
| MEDIC_HOME            | ~/.medic (the data directory)             |
| MEDIC_CONFIG          | $MEDIC_HOME/config.yaml                   |
| MEDIC_CLUSTER         | the file's `cluster`                      |
| MEDIC_DATABASE_URL    | sqlite:///$MEDIC_HOME/medic.db            |
| MEDIC_POLICY          | policies/default.yaml                     |
| MEDIC_SCHEDULER       | sim                                       |
| MEDIC_PROVIDER        | sim                                       |
| MEDIC_DIAGNOSTICS     | sim                                       |
| MEDIC_CHECKPOINTS     | sim                                       |

Credentials never go in the file (it is refused): they come from the standard boto3 chain,
the environment, or Prefect Secret blocks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

REPO_ROOT = Path(__file__).resolve().parent.parent
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|ACCESS_KEY|PRIVATE", re.IGNORECASE)


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scheduler: str | None = None
    provider: str | None = None
    diagnostics: str | None = None
    checkpoints: str | None = None
    database_url: str | None = None
    policy: str | None = None
    settings: dict[str, str] = Field(
        default_factory=dict, description="More variables for the backends, e.g. SLURM_CONF, AWS_REGION."
    )

    @field_validator("settings")
    @classmethod
    def _no_credentials(cls, value: dict[str, str]) -> dict[str, str]:
        secret = sorted(k for k in value if _SECRET.search(k))
        if secret:
            raise ValueError(
                f"credentials never go in the config file ({', '.join(secret)}): use the environment, "
                "the boto3 credential chain or a Prefect Secret block"
            )
        return value

    def as_env(self) -> dict[str, str]:
        named = {
            "MEDIC_SCHEDULER": self.scheduler,
            "MEDIC_PROVIDER": self.provider,
            "MEDIC_DIAGNOSTICS": self.diagnostics,
            "MEDIC_CHECKPOINTS": self.checkpoints,
            "MEDIC_DATABASE_URL": self.database_url,
            "MEDIC_POLICY": self.policy,
        }
        return {**self.settings, **{k: v for k, v in named.items() if v is not None}}


class ConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cluster: str | None = Field(None, description="The cluster this deployment serves by default.")
    clusters: dict[str, ClusterConfig] = Field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Settings:
    home: Path
    database_url: str
    policy_path: Path
    scheduler: str
    provider: str
    cluster: str | None
    env: Mapping[str, str]  # the effective variables: the file's cluster, then the environment


def _default_policy() -> Path:
    local = Path("policies/default.yaml")
    return local if local.is_file() else REPO_ROOT / "policies" / "default.yaml"


def _from_file(path: Path, cluster: str | None) -> tuple[str | None, dict[str, str]]:
    from medic.policy.loader import parse_yaml  # YAML with file:line errors; kept lazy for start-up

    config = parse_yaml(path.read_text(encoding="utf-8"), str(path), ConfigFile, "a mapping with `clusters:`")
    name = cluster or config.cluster
    if name is None:
        return None, {}
    if name not in config.clusters:
        known = ", ".join(sorted(config.clusters)) or "none"
        raise ValueError(f"{path}: no cluster {name!r} (known: {known})")
    return name, config.clusters[name].as_env()


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    environ = dict(os.environ) if env is None else dict(env)
    home = Path(environ.get("MEDIC_HOME") or Path.home() / ".medic").expanduser()
    config_path = Path(environ.get("MEDIC_CONFIG") or home / "config.yaml")
    cluster, from_file = (
        _from_file(config_path, environ.get("MEDIC_CLUSTER"))
        if config_path.is_file()
        else (environ.get("MEDIC_CLUSTER"), {})
    )
    merged = {**from_file, **{k: v for k, v in environ.items() if v != ""}}
    return Settings(
        home=home,
        database_url=merged.get("MEDIC_DATABASE_URL") or f"sqlite:///{home / 'medic.db'}",
        policy_path=Path(merged["MEDIC_POLICY"]) if merged.get("MEDIC_POLICY") else _default_policy(),
        scheduler=merged.get("MEDIC_SCHEDULER", "sim"),
        provider=merged.get("MEDIC_PROVIDER", "sim"),
        cluster=cluster,
        env=merged,
    )
