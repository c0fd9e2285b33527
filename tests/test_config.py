"""One config file chooses the backends per cluster; environment variables win; no credentials."""

from __future__ import annotations

from pathlib import Path

import pytest

from integrations import registry
from integrations.registry import BackendError
from integrations.sim.scheduler import SimScheduler
from medic.config import load_settings
from medic.policy import PolicyError

CONFIG = """\
cluster: train-a
clusters:
  train-a:
    scheduler: slurm
    provider: hyperpod
    diagnostics: dcgm
    settings:
      SLURM_CONF: /etc/slurm/train-a.conf
      MEDIC_HYPERPOD_CLUSTER: train-a
  lab:
    scheduler: sim
    provider: sim
"""


def write(tmp_path: Path, text: str) -> dict[str, str]:
    (tmp_path / "config.yaml").write_text(text)
    return {"MEDIC_HOME": str(tmp_path)}


def test_the_file_names_the_backends_of_the_default_cluster(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, CONFIG))
    assert (settings.cluster, settings.scheduler, settings.provider) == ("train-a", "slurm", "hyperpod")
    assert settings.env["SLURM_CONF"] == "/etc/slurm/train-a.conf"
    assert settings.env["MEDIC_DIAGNOSTICS"] == "dcgm"


def test_environment_variables_win_and_pick_the_cluster(tmp_path: Path) -> None:
    env = write(tmp_path, CONFIG)
    assert load_settings({**env, "MEDIC_PROVIDER": "ec2"}).provider == "ec2"
    lab = load_settings({**env, "MEDIC_CLUSTER": "lab"})
    assert (lab.cluster, lab.scheduler) == ("lab", "sim")
    assert isinstance(registry.from_settings(lab).scheduler, SimScheduler)


def test_without_a_file_everything_is_simulated(tmp_path: Path) -> None:
    settings = load_settings({"MEDIC_HOME": str(tmp_path)})
    assert (settings.scheduler, settings.provider, settings.cluster) == ("sim", "sim", None)
    assert settings.database_url == f"sqlite:///{tmp_path / 'medic.db'}"


def test_credentials_are_refused_with_file_and_line(tmp_path: Path) -> None:
    text = CONFIG.replace("      MEDIC_HYPERPOD_CLUSTER: train-a\n", "      AWS_SECRET_ACCESS_KEY: hunter2\n")
    with pytest.raises(PolicyError) as caught:
        load_settings(write(tmp_path, text))
    (problem,) = caught.value.problems
    assert problem.line == 8 and "credentials never go in the config file" in problem.message
    assert "hunter2" not in str(caught.value)


def test_unknown_keys_and_clusters_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"config.yaml:4:5: clusters.train-a.schedular: unknown key"):
        load_settings(write(tmp_path, CONFIG.replace("    scheduler: slurm", "    schedular: slurm")))
    with pytest.raises(ValueError, match="no cluster 'nope'"):
        load_settings({**write(tmp_path, CONFIG), "MEDIC_CLUSTER": "nope"})


def test_a_backend_missing_its_setting_is_named(tmp_path: Path) -> None:
    env = write(tmp_path, CONFIG.replace("      MEDIC_HYPERPOD_CLUSTER: train-a\n", ""))
    settings = load_settings(
        {**env, "MEDIC_SCHEDULER": "sim", "MEDIC_DIAGNOSTICS": "sim", "AWS_REGION": "us-east-1"}
    )
    with pytest.raises(BackendError, match="MEDIC_PROVIDER=hyperpod: MEDIC_HYPERPOD_CLUSTER"):
        registry.from_settings(settings)
