"""One config file chooses the backends per cluster; environment variables win; no credentials;
no backend is simulated unless the configuration says so, and the simulation knows only its fleet."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from medic.artifacts import Artifact
from medic.config import load_settings
from medic.errors import PermanentError
from medic.integrations import registry
from medic.integrations.console_notifier import ConsoleNotifier
from medic.integrations.dcgm.runner import SshRunner
from medic.integrations.gpu_reset import NvidiaSmiGpuReset
from medic.integrations.registry import BackendError, BackendNotConfiguredError
from medic.integrations.sim.fleet import SimFleet, UnknownSimNodeError
from medic.integrations.sim.gpu_reset import SimGpuReset
from medic.integrations.sim.notifier import RecordingNotifier
from medic.integrations.sim.scheduler import SimScheduler
from medic.policy import PolicyError
from medic.protocols import Message
from medic.tasks.runtime import process as runtime

BIN = Path(sys.executable).parent

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
    backends: sim
    scheduler: sim
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


def test_without_configuration_no_backend_is_chosen(tmp_path: Path) -> None:
    settings = load_settings({"MEDIC_HOME": str(tmp_path)})
    assert (settings.scheduler, settings.provider, settings.cluster) == (None, None, None)
    assert settings.database_url == f"sqlite:///{tmp_path / 'medic.db'}"
    assert settings.unconfigured() == ["scheduler", "provider", "diagnostics", "checkpoints", "notifier"]
    with pytest.raises(BackendNotConfiguredError) as caught:
        registry.from_settings(settings)
    message = str(caught.value)
    assert "no scheduler configured: set MEDIC_SCHEDULER=slurm (or MEDIC_BACKENDS=sim to simulate)" in message
    for needed in ("MEDIC_PROVIDER=", "MEDIC_DIAGNOSTICS=dcgm", "MEDIC_CHECKPOINTS=", "SLACK_BOT_TOKEN"):
        assert needed in message
    assert isinstance(caught.value, BackendError) and isinstance(caught.value, PermanentError)


def test_one_missing_role_is_named_alone(tmp_path: Path) -> None:
    env = {"MEDIC_HOME": str(tmp_path), "MEDIC_SCHEDULER": "sim", "MEDIC_PROVIDER": "sim"}
    env |= {"MEDIC_DIAGNOSTICS": "sim", "MEDIC_NOTIFIER": "sim"}
    with pytest.raises(BackendNotConfiguredError, match="no checkpoints configured") as caught:
        registry.from_settings(load_settings(env))
    assert caught.value.roles == ["checkpoints"]
    assert "scheduler" not in str(caught.value)


def test_medic_backends_sim_simulates_every_role_not_named(tmp_path: Path) -> None:
    settings = load_settings({"MEDIC_HOME": str(tmp_path), "MEDIC_BACKENDS": "sim", "MEDIC_PROVIDER": "ec2"})
    assert {r: (c.value, c.variable, c.source) for r, c in settings.backends.items()} == {
        "scheduler": ("sim", "MEDIC_BACKENDS", "env"),
        "provider": ("ec2", "MEDIC_PROVIDER", "env"),
        "diagnostics": ("sim", "MEDIC_BACKENDS", "env"),
        "checkpoints": ("sim", "MEDIC_BACKENDS", "env"),
        "notifier": ("sim", "MEDIC_BACKENDS", "env"),
    }
    backends = registry.from_settings(load_settings({"MEDIC_HOME": str(tmp_path), "MEDIC_BACKENDS": "sim"}))
    assert isinstance(backends.scheduler, SimScheduler) and isinstance(backends.notifier, RecordingNotifier)


def test_the_file_can_choose_simulation_and_says_so(tmp_path: Path) -> None:
    lab = load_settings({**write(tmp_path, CONFIG), "MEDIC_CLUSTER": "lab"})
    assert lab.backends["scheduler"].describe() == "sim (MEDIC_SCHEDULER, config file)"
    assert lab.backends["notifier"].describe() == "sim (MEDIC_BACKENDS, config file)"
    train = load_settings(write(tmp_path, CONFIG))
    assert train.unconfigured() == ["checkpoints", "notifier"]


def test_a_bad_medic_backends_value_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="MEDIC_BACKENDS='real' is not available; the only value is sim"):
        registry.from_settings(load_settings({"MEDIC_HOME": str(tmp_path), "MEDIC_BACKENDS": "real"}))


def test_the_notifier_is_slack_with_a_token_console_or_sim_when_chosen(tmp_path: Path) -> None:
    base = {"MEDIC_HOME": str(tmp_path), "MEDIC_BACKENDS": "sim"}
    slack = load_settings({**base, "SLACK_BOT_TOKEN": "xoxb-1"}).backends["notifier"]
    assert (slack.value, slack.variable) == ("slack", "SLACK_BOT_TOKEN")
    console = registry.from_settings(load_settings({**base, "MEDIC_NOTIFIER": "console"})).notifier
    assert isinstance(console, ConsoleNotifier)
    with pytest.raises(
        BackendError, match="MEDIC_NOTIFIER=slack: set SLACK_BOT_TOKEN or MEDIC_SLACK_TOKEN_BLOCK"
    ):
        registry.from_settings(load_settings({**base, "MEDIC_NOTIFIER": "slack"}))
    with pytest.raises(BackendError, match="MEDIC_NOTIFIER='email' is not available"):
        registry.from_settings(load_settings({**base, "MEDIC_NOTIFIER": "email"}))
    links = {"MEDIC_ARTIFACT_ROOT": "/shared/medic", "MEDIC_ARTIFACT_URL": "files.example/medic"}
    with pytest.raises(
        BackendError, match="SLACK_BOT_TOKEN=slack: MEDIC_ARTIFACT_URL='files\\.example/medic'"
    ):
        registry.from_settings(load_settings({**base, "SLACK_BOT_TOKEN": "xoxb-1", **links}))


def test_the_gpu_reset_is_simulated_beside_a_simulated_provider_and_real_only_when_chosen(
    tmp_path: Path,
) -> None:
    base = {"MEDIC_HOME": str(tmp_path), "MEDIC_BACKENDS": "sim"}
    assert isinstance(registry.from_settings(load_settings(base)).gpu_reset, SimGpuReset)
    slurm = {**base, "MEDIC_PROVIDER": "slurm"}
    assert registry.from_settings(load_settings(slurm)).gpu_reset is None  # the provider's reboot
    chosen = {**slurm, "MEDIC_GPU_RESET": "nvidia-smi"}
    resetter = registry.from_settings(load_settings(chosen)).gpu_reset
    assert isinstance(resetter, NvidiaSmiGpuReset) and isinstance(resetter.runner, SshRunner)
    with pytest.raises(BackendError, match="MEDIC_GPU_RESET=nvidia-smi: MEDIC_DCGM_RUNNER='rsh'"):
        registry.from_settings(load_settings({**chosen, "MEDIC_DCGM_RUNNER": "rsh"}))
    # A GPU is reset on a drained node, where srun gets no allocation.
    with pytest.raises(BackendError, match="MEDIC_DCGM_RUNNER=srun cannot reach a drained node"):
        registry.from_settings(load_settings({**chosen, "MEDIC_DCGM_RUNNER": "srun"}))
    with pytest.raises(BackendError, match="MEDIC_GPU_RESET='ipmi' is not available; choose one of"):
        registry.from_settings(load_settings({**slurm, "MEDIC_GPU_RESET": "ipmi"}))


def test_the_console_notifier_writes_every_message() -> None:
    stream = io.StringIO()
    notifier = ConsoleNotifier(stream)
    dump = Artifact("stack dump of rank 3 on gpu-001", "/shared/medic/llm-r3-step12-stacks.txt")
    ref = notifier.post(
        Message("inc-1", "#gpu", "Hardware fault on gpu-001: reboot", "rebooted", artifacts=(dump,))
    )
    notifier.reply(ref, "verified at DCGM level 1")
    assert stream.getvalue() == (
        "[medic sim-1] #gpu: Hardware fault on gpu-001: reboot\nrebooted\n"
        "stack dump of rank 3 on gpu-001: /shared/medic/llm-r3-step12-stacks.txt\n"
        "[medic sim-1] verified at DCGM level 1\n"
    )


def test_a_flow_runtime_refuses_to_start_unconfigured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "_current", None)
    monkeypatch.delenv("MEDIC_BACKENDS")
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path))
    monkeypatch.setenv("MEDIC_SCHEDULER", "sim")
    with pytest.raises(BackendNotConfiguredError) as caught:
        runtime.current()
    assert caught.value.roles == ["provider", "diagnostics", "checkpoints", "notifier"]


# --- the simulation never stands in for a real node ---------------------------------------------


def test_the_simulation_refuses_nodes_outside_its_fleet() -> None:
    backends, fleet = registry.simulated(SimFleet.build(nodes=4))
    result = backends.diagnostics.run("a100-017", 1, timeout_s=60)
    assert result.result == "error"
    assert (
        "a100-017 is not in the simulated fleet (gpu-node-1, gpu-node-2, gpu-node-3, gpu-node-4)"
        in result.detail
    )
    for call in (
        lambda: backends.scheduler.node("a100-017"),
        lambda: backends.scheduler.drain("a100-017", "medic: test"),
        lambda: backends.scheduler.resume("a100-017"),
        lambda: backends.scheduler.jobs_on_node("a100-017"),
        lambda: backends.provider.reboot("a100-017"),
        lambda: backends.provider.reset_gpu("a100-017", 0),
        lambda: backends.provider.replace("a100-017"),
        lambda: backends.provider.booted_at("a100-017"),
        lambda: backends.provider.wait_ready("a100-017", 1),
    ):
        with pytest.raises(UnknownSimNodeError, match="a100-017 is not in the simulated fleet"):
            call()
    assert "a100-017" not in fleet.nodes  # nothing joined the fleet on the way
    assert backends.diagnostics.run("gpu-node-2", 1, timeout_s=60).result == "pass"


# --- `medic ingest` and `medic serve` with nothing configured -------------------------------------


def _clean_env(tmp_path: Path, **more: str) -> dict[str, str]:
    """Only what a shell on a fresh machine has: no MEDIC_BACKENDS, no backend variable."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    return env | {"MEDIC_HOME": str(tmp_path / "home"), "PREFECT_HOME": str(tmp_path / "prefect"), **more}


def _events(tmp_path: Path) -> Path:
    now = datetime.now(UTC).isoformat()
    lines = [
        {"id": "e-1", "time": now, "source": "agent", "kind": "xid", "node": "a100-017", "gpu": 0,
         "attributes": {"code": 79}},
        {"id": "e-2", "time": now, "source": "agent", "kind": "xid", "node": "gpu-node-3", "gpu": 1,
         "attributes": {"code": 79}},
    ]  # fmt: skip
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("dry_run", [False, True])
def test_ingest_refuses_to_start_unconfigured(tmp_path: Path, dry_run: bool) -> None:
    args = [str(BIN / "medic"), "ingest", *(["--dry-run"] if dry_run else []), str(_events(tmp_path))]
    done = subprocess.run(args, env=_clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        "no scheduler configured: set MEDIC_SCHEDULER=slurm (or MEDIC_BACKENDS=sim to simulate)"
        in done.stderr
    )
    assert "no notifier configured" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "home" / "medic.db").exists()  # stopped before anything was stored


def test_ingest_dry_run_with_simulation_chosen(tmp_path: Path) -> None:
    env = _clean_env(tmp_path, MEDIC_BACKENDS="sim", COLUMNS="300")
    args = [str(BIN / "medic"), "ingest", "--dry-run", str(_events(tmp_path))]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "reboot gpu-node-3" in done.stdout
    # A node the simulated fleet does not have is named, not silently simulated.
    assert "a100-017 is not in the simulated fleet" in done.stderr


def test_serve_refuses_to_start_unconfigured(tmp_path: Path) -> None:
    env = _clean_env(tmp_path, MEDIC_INGEST_TOKENS="t0ken", MEDIC_SCHEDULER="slurm")
    done = subprocess.run(
        [str(BIN / "medic"), "serve", "--port", "1"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no provider configured: set MEDIC_PROVIDER=slurm|hyperpod|ec2" in done.stderr
    assert "no scheduler configured" not in done.stderr and "Traceback" not in done.stderr


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
        {
            **env,
            "MEDIC_BACKENDS": "sim",
            "MEDIC_SCHEDULER": "sim",
            "MEDIC_DIAGNOSTICS": "sim",
            "AWS_REGION": "us-east-1",
        }
    )
    with pytest.raises(BackendError, match="MEDIC_PROVIDER=hyperpod: MEDIC_HYPERPOD_CLUSTER"):
        registry.from_settings(settings)


@pytest.mark.parametrize("provider", ["ec2", "hyperpod"])
def test_an_aws_provider_sees_the_configured_scheduler(provider: str, tmp_path: Path) -> None:
    # Beside a scheduler, an AWS provider must see an admin's drain there before it reboots.
    env = {
        "MEDIC_HOME": str(tmp_path),
        "MEDIC_BACKENDS": "sim",
        "MEDIC_PROVIDER": provider,
        "MEDIC_HYPERPOD_CLUSTER": "ml-cluster",
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }
    backends = registry.from_settings(load_settings(env))
    assert isinstance(backends.scheduler, SimScheduler)
    assert backends.provider.scheduler is backends.scheduler  # type: ignore[attr-defined]  # theirs, not the Protocol's
