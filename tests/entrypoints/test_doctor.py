"""`medic doctor`: the resolved configuration, then each needed backend probed for real.

The store, Slack (the local Web API stand-in), Slurm (the real local cluster of test_slurm.py) and
DCGM (a stand-in dcgmi on this machine) are asked for real; nothing is mocked in-process.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from checkout import TEST_FIXTURES
from gpu_reset_support import H200, Node, eight_gpus
from slack_api import SlackApi, running_slack_api
from slurm_cluster import Cluster, cluster  # noqa: F401  (the module's real Slurm cluster fixture)

from medic import __version__
from medic.integrations.gpu_reset import GPUS
from medic.integrations.probes import probe_aws, probe_prefect_ui, probe_store
from medic.store.migrate import HEAD

BIN = Path(sys.executable).parent
TOKEN = "xoxb-1234-doctor-test"


def doctor(tmp_path: Path, *args: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    """`medic doctor` as a separate process: the test's MEDIC_BACKENDS=sim plus `env` (None unsets)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLACK_", "MEDIC_", "PREFECT_API_URL"))}
    full |= {
        "MEDIC_HOME": str(tmp_path / "home"),
        "MEDIC_BACKENDS": "sim",
        "PREFECT_HOME": str(tmp_path / "p"),
    }
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    return subprocess.run(
        [str(BIN / "medic"), "doctor", *args], env=full, capture_output=True, text=True, timeout=60
    )


def lines(done: subprocess.CompletedProcess[str]) -> dict[str, tuple[str, str]]:
    """name -> (status, the rest) for each probe line."""
    found: dict[str, tuple[str, str]] = {}
    for line in done.stdout.splitlines():
        status, _, rest = line.partition("  ")
        if status.strip() in ("ok", "fail", "skip"):
            name, _, detail = rest.strip().partition(" ")
            found[name] = (status.strip(), detail.strip())
    return found


def as_json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    return json.loads(done.stdout)


def test_simulation_everything_needed_answers(tmp_path: Path) -> None:
    done = doctor(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    probes = lines(done)
    assert probes["store"][0] == "ok" and probes["policy"][0] == "ok"
    assert "44 rules" in probes["policy"][1] or "rules, sha256" in probes["policy"][1]
    assert {name for name, (status, _) in probes.items() if status == "skip"} == {
        "slurm",
        "dcgm",
        "gpu-reset",
        "aws",
        "checkpoints",
        "slack",
        "prefect",
        "prefect-ui",
    }
    assert "  scheduler    sim (MEDIC_BACKENDS, env)" in done.stdout
    assert "everything needed answers" in done.stdout


def test_json_shape(tmp_path: Path) -> None:
    database = tmp_path / "medic.db"
    database.touch()
    done = doctor(
        tmp_path,
        "--json",
        MEDIC_SCHEDULER="sim",
        MEDIC_CHECKPOINTS=str(tmp_path),
        MEDIC_DATABASE_URL=f"sqlite:///{database}",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = as_json(done)
    assert set(report) == {
        "config_file",
        "cluster",
        "home",
        "store",
        "policy",
        "backends",
        "errors",
        "probes",
        "ok",
        "exit_code",
        "versions",
    }
    assert (report["ok"], report["exit_code"], report["errors"]) == (True, 0, [])
    versions = report["versions"]
    assert set(versions) == {"gpu-medic", "store schema", "prefect", "slurm", "dcgm"}
    assert (versions["gpu-medic"], versions["store schema"]) == (__version__, HEAD)
    assert versions["prefect"] == metadata.version("prefect")
    assert versions["dcgm"] == "not found"  # no dcgmi here, and MEDIC_DCGMI names none
    # Slurm's tools print their version only once they find a configuration; none is named here.
    assert versions["slurm"] == "not found" or versions["slurm"].startswith("unreadable (rc="), versions
    assert report["backends"]["scheduler"] == {"value": "sim", "source": "env", "variable": "MEDIC_SCHEDULER"}
    assert report["backends"]["provider"] == {"value": "sim", "source": "env", "variable": "MEDIC_BACKENDS"}
    assert len(report["policy"]["sha256"]) == 64
    probes = {p["name"]: p for p in report["probes"]}
    assert list(probes) == [
        "store",
        "policy",
        "slurm",
        "dcgm",
        "gpu-reset",
        "aws",
        "checkpoints",
        "slack",
        "prefect",
        "prefect-ui",
    ]
    assert set(probes["store"]) == {"name", "status", "target", "detail"}
    assert probes["store"]["status"] == "ok" and "SQLite" in probes["store"]["detail"]
    assert probes["checkpoints"]["status"] == "ok"


def test_nothing_configured_is_a_configuration_error(tmp_path: Path) -> None:
    done = doctor(tmp_path, MEDIC_BACKENDS=None)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "not configured: set MEDIC_SCHEDULER=slurm (or MEDIC_BACKENDS=sim)" in done.stdout
    assert (
        "no scheduler configured: set MEDIC_SCHEDULER=slurm (or MEDIC_BACKENDS=sim to simulate)"
        in done.stderr
    )
    assert lines(done)["store"][0] == "ok"  # the rest is still probed


def test_a_store_that_does_not_answer_fails_with_the_password_masked(tmp_path: Path) -> None:
    url = "postgresql+psycopg://postgres:hunter2@127.0.0.1:1/x"
    done = doctor(tmp_path, "--json", MEDIC_DATABASE_URL=url)
    assert done.returncode == 1, done.stdout + done.stderr
    report = as_json(done)
    assert report["store"] == "postgresql+psycopg://postgres:***@127.0.0.1:1/x"
    store = next(p for p in report["probes"] if p["name"] == "store")
    assert store["status"] == "fail" and "refused" in store["detail"].lower()
    assert "hunter2" not in done.stdout + done.stderr


def test_the_store_probe_answers_on_postgresql(postgres_url: str) -> None:
    probe = probe_store(postgres_url)
    assert (probe.status, probe.detail.split(" (")[0]) == ("ok", "SELECT 1 answered"), probe
    assert "PostgreSQL" in probe.detail


# --- Slack --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slack_api() -> Iterator[SlackApi]:
    with running_slack_api(TOKEN, {"gpu-medic": "C0MEDIC"}) as api:
        yield api


def test_slack_answers_auth_test(tmp_path: Path, slack_api: SlackApi) -> None:
    done = doctor(tmp_path, SLACK_BOT_TOKEN=TOKEN, SLACK_API_URL=slack_api.api_url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines(done)["slack"] == (
        "ok",
        f"{slack_api.api_url}  auth.test ok: team medic-test, bot user medic",
    )
    assert "  notifier     slack (SLACK_BOT_TOKEN, env)" in done.stdout
    assert TOKEN not in done.stdout + done.stderr


def test_slack_with_a_bad_token_fails(tmp_path: Path, slack_api: SlackApi) -> None:
    done = doctor(tmp_path, SLACK_BOT_TOKEN="xoxb-wrong", SLACK_API_URL=slack_api.api_url)
    assert done.returncode == 1, done.stdout + done.stderr
    status, detail = lines(done)["slack"]
    assert status == "fail" and detail.endswith("auth.test: invalid_auth")


# --- DCGM (a stand-in dcgmi: this machine has no GPU) ---------------------------------------------


def _dcgmi(tmp_path: Path, discovery_rc: int) -> Path:
    script = tmp_path / "dcgmi"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "dcgmi  version: 3.3.5"; exit 0; fi\n'
        f'if [ {discovery_rc} -ne 0 ]; then echo "Error: unable to establish a connection to the specified '
        f'host: localhost"; exit {discovery_rc}; fi\n'
        'echo "8 GPUs found."\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.mark.parametrize(
    ("dcgmi", "status", "detail"),
    [
        ("ok", "ok", "dcgmi 3.3.5; nv-hostengine answers (8 GPUs found)"),
        ("down", "fail", "dcgmi 3.3.5; nv-hostengine: rc=255: Error: unable to establish a connection"),
        ("missing", "fail", "No such file or directory"),
    ],
)
def test_dcgm_through_the_configured_runner(tmp_path: Path, dcgmi: str, status: str, detail: str) -> None:
    path = {
        "ok": lambda: _dcgmi(tmp_path, 0),
        "down": lambda: _dcgmi(tmp_path, 255),
        "missing": lambda: tmp_path / "nowhere" / "dcgmi",
    }[dcgmi]()
    done = doctor(tmp_path, MEDIC_DIAGNOSTICS="dcgm", MEDIC_DCGM_RUNNER="local", MEDIC_DCGMI=str(path))
    assert done.returncode == (0 if status == "ok" else 1), done.stdout + done.stderr
    got_status, got = lines(done)["dcgm"]
    assert got_status == status and detail in got, got
    version = "not found" if dcgmi == "missing" else "3.3.5"
    assert f"\n  dcgm         {version}\n" in done.stdout


# --- Slurm: the real local cluster ----------------------------------------------------------------


@pytest.mark.system
# --- the GPU reset's nvidia-smi (recorded answers: this machine has no GPU) ------------------------


@pytest.mark.parametrize(
    ("answers", "status", "detail"),
    [
        ({GPUS: [(H200, 0)]}, "ok", "1 GPUs; a reset takes one GPU at a time"),
        (
            {GPUS: [(eight_gpus((8, 0)), 0)]},
            "ok",
            "8 GPUs; a reset takes every GPU of the node together (compute capability 8.0: before Hopper, "
            "NVLink peers are reset together)",
        ),
        ({GPUS: [("No devices were found\n", 6)]}, "fail", "rc=6: No devices were found"),
    ],
)
def test_the_gpu_reset_reads_the_gpus_through_its_runner(
    tmp_path: Path, answers: dict[tuple[str, ...], list[tuple[str, int]]], status: str, detail: str
) -> None:
    node = Node(tmp_path)
    node.answer(answers)
    nvidia_smi = str(tmp_path / "nvidia-smi")
    done = doctor(
        tmp_path, MEDIC_GPU_RESET="nvidia-smi", MEDIC_DCGM_RUNNER="local", MEDIC_NVIDIA_SMI=nvidia_smi
    )
    assert lines(done)["gpu-reset"] == (
        status,
        f"{nvidia_smi} on {socket.gethostname()} (runner local)  {detail}",
    )
    assert node.calls() == [" ".join(GPUS)]  # it reads, and asks for nothing else
    refused = doctor(tmp_path, MEDIC_GPU_RESET="nvidia-smi", MEDIC_DCGM_RUNNER="srun")
    assert lines(refused)["gpu-reset"][0] == "fail" and "cannot reach a drained node" in refused.stdout


def test_slurm_controller_answers_with_its_version(tmp_path: Path, cluster: Cluster) -> None:  # noqa: F811
    conf = cluster.base / "etc" / "slurm.conf"
    done = doctor(tmp_path, MEDIC_SCHEDULER="slurm", SLURM_CONF=str(conf))
    assert done.returncode == 0, done.stdout + done.stderr
    status, detail = lines(done)["slurm"]
    assert status == "ok" and " is UP; " in detail, detail
    # Read from the controller's configuration: scripts/slurm-cluster.sh shortens it from 120 s.
    assert "; a requeued job starts again after 10 s (AuthInfo cred_expire); slurm" in detail, detail
    assert "  scheduler    slurm (MEDIC_SCHEDULER, env)" in done.stdout
    # The version the probe read from the controller's `sinfo --version`, in the Versions section too.
    found = re.search(r"; slurm\S*\s+(\S+)$", detail)  # "slurm 22.05.8", Debian's "slurm-wlm 22.05.8"
    assert found, detail
    assert f"\n  slurm        {found.group(1)}\n" in done.stdout


@pytest.mark.system
def test_slurm_controller_not_running_fails(tmp_path: Path, cluster: Cluster) -> None:  # noqa: F811
    # The same cluster's configuration with the controller's port moved where nothing listens.
    conf = (cluster.base / "etc" / "slurm.conf").read_text()
    down = cluster.base / "etc" / f"down-{os.getpid()}.conf"
    down.write_text("".join(f"{line}\n" if not line.startswith("SlurmctldPort=") else "SlurmctldPort=1\n"
                            for line in conf.splitlines()))  # fmt: skip
    done = doctor(tmp_path, MEDIC_PROVIDER="slurm", SLURM_CONF=str(down))
    assert done.returncode == 1, done.stdout + done.stderr
    status, detail = lines(done)["slurm"]
    assert status == "fail" and "is DOWN" in detail and "*" not in detail, detail


# --- Prefect's API and AWS ----------------------------------------------------------------------


class _PrefectApi(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = {"/api/health": b"true", "/api/admin/version": b'"3.0.0-test"'}.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body or b"{}")


def test_prefect_api_health(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PrefectApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/api"
        done = doctor(tmp_path, PREFECT_API_URL=url)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines(done)["prefect"] == ("ok", f"{url}  /health answered (server 3.0.0-test)")

    refused = doctor(tmp_path, PREFECT_API_URL=url)  # the server is gone now
    assert refused.returncode == 1 and lines(refused)["prefect"][0] == "fail"
    unset = doctor(tmp_path, MEDIC_DISPATCH="prefect")
    assert unset.returncode == 1
    assert lines(unset)["prefect"] == ("fail", "MEDIC_DISPATCH=prefect needs PREFECT_API_URL")


PREFECT_ANSWERS = TEST_FIXTURES / "prefect"


def _ui_settings_server(document: str) -> ThreadingHTTPServer:
    """Serves one recorded `/ui-settings` answer (tests/fixtures/prefect), its API's port made this
    server's own where the recording pointed the UI at its own server."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/ui-settings" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            port = str(self.server.server_address[1])
            self.wfile.write(
                document.replace("19483", port).encode() if self.path == "/ui-settings" else b"{}"
            )

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize(
    ("recorded", "status", "detail"),
    [
        ("ui-settings-default-port.json", "fail", "the UI sends browsers to http://127.0.0.1:4200/api, not {api}:"
         " start the server with PREFECT_UI_API_URL={api}"),
        ("ui-settings-ui-api-url.json", "ok", "the UI reads runs from {api}"),
        ("ui-settings-ui-disabled.json", "skip", "this server serves no UI (Prefect Cloud, or the UI is off)"),
    ],
)  # fmt: skip
def test_the_prefect_ui_must_read_from_the_same_api(recorded: str, status: str, detail: str) -> None:
    server = _ui_settings_server((PREFECT_ANSWERS / recorded).read_text())
    try:
        api = f"http://localhost:{server.server_address[1]}/api"
        found = probe_prefect_ui({"PREFECT_API_URL": api})
    finally:
        server.shutdown()
        server.server_close()
    shown = api.replace("localhost", "127.0.0.1")
    assert (found.status, found.detail) == (status, detail.format(api=api if status == "fail" else shown))
    assert probe_prefect_ui({"PREFECT_HOME": "/nonexistent"}).status == "skip"  # embedded: no server


@pytest.fixture(scope="module")
def moto_sts() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def test_aws_identity_through_the_standard_chain(moto_sts: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    env = {"AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto_sts}

    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    no_credentials = probe_aws(env)
    assert no_credentials.status == "fail" and "credentials" in no_credentials.detail.lower()

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    probe = probe_aws(env)
    assert (probe.status, probe.target) == ("ok", "sts get-caller-identity (us-east-1)")
    assert probe.detail.startswith("account 123456789012 as arn:aws:")
