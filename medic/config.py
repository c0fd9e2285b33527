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
| MEDIC_SCHEDULER       | none: must be configured                  |
| MEDIC_PROVIDER        | none: must be configured                  |
| MEDIC_DIAGNOSTICS     | none: must be configured                  |
| MEDIC_CHECKPOINTS     | none: must be configured                  |
| MEDIC_NOTIFIER        | slack when SLACK_BOT_TOKEN / MEDIC_SLACK_TOKEN_BLOCK is set |
| MEDIC_BACKENDS        | `sim`: simulate every role not named otherwise |
| MEDIC_AUDIT_KEY       | unset: the audit chain is hashed, not keyed   |

No backend role defaults to the simulation: a role is configured by its variable (or the
file's cluster section), or simulated because MEDIC_BACKENDS=sim says so (`backend_choices`).
Credentials never go in the file (it is refused): they come from the standard boto3 chain,
the environment, or Prefect Secret blocks. The audit key is one: it is read from the environment only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from medic.artifacts import ARTIFACT_ROOT_VAR
from medic.shipped import SHIPPED_POLICY

_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|ACCESS_KEY|PRIVATE|AUDIT_KEY", re.IGNORECASE)
# The key of the store's audit chain (docs/store.md#tamper-evidence): HMAC, so that someone who can
# edit the database cannot recompute the chain without it.
AUDIT_KEY_VAR = "MEDIC_AUDIT_KEY"


# Each backend role and the variable that configures it (docs/config.md).
BACKEND_ROLES: dict[str, str] = {
    "scheduler": "MEDIC_SCHEDULER",
    "provider": "MEDIC_PROVIDER",
    "diagnostics": "MEDIC_DIAGNOSTICS",
    "checkpoints": "MEDIC_CHECKPOINTS",
    "notifier": "MEDIC_NOTIFIER",
}
BACKENDS_VAR = "MEDIC_BACKENDS"  # `sim`: every role not named otherwise is simulated
SLACK_TOKEN_VARS = ("SLACK_BOT_TOKEN", "MEDIC_SLACK_TOKEN_BLOCK")


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backends: str | None = Field(None, description="`sim`: simulate every role this section does not name.")
    scheduler: str | None = None
    provider: str | None = None
    diagnostics: str | None = None
    checkpoints: str | None = None
    notifier: str | None = None
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
            BACKENDS_VAR: self.backends,
            "MEDIC_NOTIFIER": self.notifier,
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
class Choice:
    """One backend role's configured value and where it came from; `value` None: not configured."""

    role: str
    value: str | None
    source: str | None  # where `variable` was set: "env" or "config file"; None when not configured
    variable: str  # the variable that decided it (MEDIC_SCHEDULER, MEDIC_BACKENDS, SLACK_BOT_TOKEN, ...)

    def describe(self) -> str:
        if self.value is None:
            return "not configured"
        return f"{self.value} ({self.variable}, {self.source})"


@dataclass(frozen=True, slots=True)
class Settings:
    home: Path
    database_url: str
    policy_path: Path
    cluster: str | None
    env: Mapping[str, str]  # the effective variables: the file's cluster, then the environment
    backends: Mapping[str, Choice]  # role -> its choice, for every role in BACKEND_ROLES
    config_path: Path | None = None  # the config file that was read, if there was one

    @property
    def scheduler(self) -> str | None:
        return self.backends["scheduler"].value

    @property
    def provider(self) -> str | None:
        return self.backends["provider"].value

    @property
    def artifact_root(self) -> Path:
        """Where GPU Medic writes the evidence it gathers itself (docs/host-evidence.md): under
        MEDIC_ARTIFACT_ROOT, where the jobs' files are served from, else in the data directory."""
        root = self.env.get(ARTIFACT_ROOT_VAR)
        return Path(root) if root else self.home / "artifacts"

    def unconfigured(self) -> list[str]:
        """The roles nothing configures, in BACKEND_ROLES order."""
        return [role for role, choice in self.backends.items() if choice.value is None]


def _default_policy() -> Path:
    local = Path("policies/default.yaml")
    return local if local.is_file() else SHIPPED_POLICY


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


def backend_choices(merged: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, Choice]:
    """Each role's backend: its own variable (env, else the config file), for the notifier a Slack
    token, else MEDIC_BACKENDS (`sim`); never a silent default."""

    def origin(variable: str) -> str:
        return "env" if environ.get(variable) else "config file"

    choices: dict[str, Choice] = {}
    fallback = merged.get(BACKENDS_VAR) or None
    for role, variable in BACKEND_ROLES.items():
        if merged.get(variable):
            choice = Choice(role, merged[variable], origin(variable), variable)
        elif role == "notifier" and (token := next((v for v in SLACK_TOKEN_VARS if merged.get(v)), None)):
            choice = Choice(role, "slack", origin(token), token)
        elif fallback is not None:
            choice = Choice(role, fallback, origin(BACKENDS_VAR), BACKENDS_VAR)
        else:
            choice = Choice(role, None, None, variable)
        choices[role] = choice
    return choices


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    environ = dict(os.environ) if env is None else dict(env)
    home = Path(environ.get("MEDIC_HOME") or Path.home() / ".medic").expanduser()
    config_path = Path(environ.get("MEDIC_CONFIG") or home / "config.yaml")
    has_file = config_path.is_file()
    cluster, from_file = (
        _from_file(config_path, environ.get("MEDIC_CLUSTER"))
        if has_file
        else (environ.get("MEDIC_CLUSTER"), {})
    )
    set_here = {k: v for k, v in environ.items() if v != ""}
    merged = {**from_file, **set_here}
    return Settings(
        home=home,
        database_url=merged.get("MEDIC_DATABASE_URL") or f"sqlite:///{home / 'medic.db'}",
        policy_path=Path(merged["MEDIC_POLICY"]) if merged.get("MEDIC_POLICY") else _default_policy(),
        cluster=cluster,
        env=merged,
        backends=backend_choices(merged, set_here),
        config_path=config_path if has_file else None,
    )


def audit_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The audit chain's key, from the environment only: a credential never comes from the file."""
    return (os.environ if environ is None else environ).get(AUDIT_KEY_VAR) or None
