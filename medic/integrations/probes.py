"""`medic doctor`'s probes: ask each outside system the configuration names whether it answers.

One function per system, each bounded by PROBE_TIMEOUT_S and returning a `Probe` (ok, fail or
skip, with what was asked and what came back) instead of raising: a probe that cannot run is a
failed probe. `probe_all` runs the ones the settings need; the CLI (medic/apps/cli/doctor.py) prints.
Nothing here changes anything: the store is pinged (SELECT 1), not created.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from medic import __version__
from medic.config import Settings

PROBE_TIMEOUT_S = 5.0
Status = Literal["ok", "fail", "skip"]
Env = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Probe:
    name: str  # store, policy, slurm, dcgm, gpu-reset, aws, checkpoints, slack, prefect
    status: Status
    target: str  # what was asked: a URL, a path, a command's node; "" when nothing was
    detail: str  # what came back, or why it was skipped

    def line(self) -> str:
        """`ok|fail|skip  NAME  TARGET  DETAIL`, the text form of `medic doctor`."""
        return (
            f"{self.status:<4}  {self.name:<11}  " + (f"{self.target}  " if self.target else "") + self.detail
        )

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _problem(error: BaseException) -> str:
    said = " ".join(str(error).split()) or type(error).__name__
    return said[:300]


def masked_url(url: str) -> str:
    """The database URL with its password replaced by ***."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return re.sub(r"(//[^:/@]+:)[^@]*@", r"\1***@", url)


# --- the store and the policy -------------------------------------------------------------------


def probe_store(url: str) -> Probe:
    """Connect and SELECT 1 (connect timeout PROBE_TIMEOUT_S). A SQLite file that does not exist
    yet is fine when its directory can be made: the first command creates it."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    what = masked_url(url)
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        if not path.exists():
            parent = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
            if parent is None or not parent.is_dir():
                return Probe("store", "fail", what, f"cannot create {path.parent}")
            return Probe("store", "ok", what, "SQLite file not created yet: the first command creates it")
    connect_args: dict[str, Any] = {}
    if url.startswith("postgresql"):
        connect_args["connect_timeout"] = int(PROBE_TIMEOUT_S)
    elif url.startswith("sqlite"):
        connect_args["timeout"] = PROBE_TIMEOUT_S
    try:
        engine = create_engine(url, connect_args=connect_args, poolclass=NullPool)
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))
                version = ".".join(str(v) for v in engine.dialect.server_version_info or ())
        finally:
            engine.dispose()
    except Exception as error:  # any driver's error: the store does not answer
        return Probe("store", "fail", what, _problem(getattr(error, "orig", None) or error))
    name = {"postgresql": "PostgreSQL", "sqlite": "SQLite"}.get(engine.dialect.name, engine.dialect.name)
    return Probe("store", "ok", what, f"SELECT 1 answered ({name} {version})".rstrip())


def probe_policy(path: Path) -> Probe:
    from medic.policy import PolicyError, load_policy

    try:
        loaded = load_policy(path)
    except PolicyError as error:
        return Probe("policy", "fail", str(path), _problem(error))
    return Probe("policy", "ok", str(path), f"{len(loaded.policy.rules)} rules, sha256 {loaded.sha256}")


# --- Slurm and DCGM ------------------------------------------------------------------------------


def probe_slurm(env: Env) -> Probe:
    """`scontrol ping` (the controller answers) and `sinfo --version`."""
    from medic.integrations.slurm.cli import SlurmCli
    from medic.integrations.slurm.errors import SlurmCommandError

    cli = SlurmCli(slurm_conf=env.get("SLURM_CONF"), timeout_s=PROBE_TIMEOUT_S)
    what = f"SLURM_CONF={env['SLURM_CONF']}" if env.get("SLURM_CONF") else "default slurm.conf"
    try:
        ping = " ".join(cli.run("scontrol", "ping").split())
        version = cli.run("sinfo", "--version").strip()
    except SlurmCommandError as error:
        # scontrol ping follows "... is DOWN" with a banner of asterisks: keep the sentence.
        return Probe("slurm", "fail", what, re.sub(r"\s*\*\*.*$", "", _problem(error)))
    if " is UP" not in ping:  # older Slurm exits 0 with "... is DOWN"
        return Probe("slurm", "fail", what, ping or "scontrol ping printed nothing")
    return Probe("slurm", "ok", what, f"{ping}{_requeue_wait(cli)}; {version}")


# Slurm's own default for AuthInfo's cred_expire (slurm.conf(5)).
CRED_EXPIRE_DEFAULT_S = 120


def _requeue_wait(cli: Any) -> str:
    """How long Slurm holds a requeued job back: the job credential's lifetime (AuthInfo cred_expire),
    the floor under every restart after a requeue (docs/recovery.md)."""
    from medic.integrations.slurm.errors import SlurmCommandError

    try:
        config = cli.run("scontrol", "show", "config")
    except SlurmCommandError:
        return ""  # the ping answered: the version and state are still worth printing
    found = re.search(r"cred_expire=(\d+)", config)
    seconds, source = (
        (int(found.group(1)), "AuthInfo cred_expire") if found else (CRED_EXPIRE_DEFAULT_S, "default")
    )
    return f"; a requeued job starts again after {seconds} s ({source})"


def _first_node(env: Env) -> str | None:
    from medic.integrations.slurm.cli import SlurmCli
    from medic.integrations.slurm.errors import SlurmCommandError

    try:
        nodes = SlurmCli(slurm_conf=env.get("SLURM_CONF"), timeout_s=PROBE_TIMEOUT_S).nodes()
    except SlurmCommandError:
        return None
    return nodes[0].name if nodes else None


# `dcgmi --version` prints its build information, a "Version : 3.3.5" line among others.
DCGMI_VERSION = r"version\s*:?\s*([0-9][\w.]*)"


def probe_dcgm(env: Env, node: str | None = None, settings: Settings | None = None) -> Probe:
    """`dcgmi --version` and `dcgmi discovery -l` (nv-hostengine answers) on one node, through the
    configured runner (MEDIC_DCGM_RUNNER, MEDIC_DCGMI): this machine for the local runner, else
    `node`, else the first node Slurm lists."""
    from medic.integrations.dcgm.runner import RunnerConfigError, runner_from_env

    dcgmi = env.get("MEDIC_DCGMI") or "dcgmi"
    try:
        runner = runner_from_env(env)
    except RunnerConfigError as error:
        return Probe("dcgm", "fail", "", _problem(error))
    node = _node_to_ask(env, runner, node, settings)
    what = f"{dcgmi} on {node or '?'} (runner {env.get('MEDIC_DCGM_RUNNER') or 'ssh'})"
    if node is None:
        return Probe("dcgm", "fail", what, "no node to ask: give --node NODE")
    version = runner.run(node, [dcgmi, "--version"], PROBE_TIMEOUT_S)
    problem = _run_problem(version)
    if problem:
        return Probe("dcgm", "fail", what, problem)
    found = re.search(DCGMI_VERSION, version.stdout, re.IGNORECASE)
    said = f"dcgmi {found.group(1)}" if found else "dcgmi runs"
    discovery = runner.run(node, [dcgmi, "discovery", "-l"], PROBE_TIMEOUT_S)
    problem = _run_problem(discovery)
    if problem:
        return Probe("dcgm", "fail", what, f"{said}; nv-hostengine: {problem}")
    gpus = re.search(r"(\d+)\s+GPUs?\s+found", discovery.stdout, re.IGNORECASE)
    return Probe("dcgm", "ok", what, f"{said}; nv-hostengine answers ({gpus.group(0) if gpus else 'listed'})")


def _node_to_ask(env: Env, runner: Any, node: str | None, settings: Settings | None) -> str | None:
    """`node`, else this machine for the local runner, else the first node Slurm lists."""
    from medic.integrations.dcgm.runner import LocalRunner

    if node is None and isinstance(runner, LocalRunner):
        node = socket.gethostname()
    if node is None and settings is not None and "slurm" in (settings.scheduler, settings.provider):
        node = _first_node(env)
    return node


def probe_gpu_reset(env: Env, node: str | None = None, settings: Settings | None = None) -> Probe:
    """MEDIC_GPU_RESET=nvidia-smi: the GPUs as the reset reads them, on one node (as the dcgm probe
    picks it) through the runner the reset uses, and what a reset there takes: the GPU alone, or
    every GPU of the node (docs/gpu-reset.md). Reads only."""
    from medic.integrations.gpu_reset import GPUS, NvidiaSmiGpuReset, UnreadableOutputError, parse_gpus, scope

    try:
        resetter = NvidiaSmiGpuReset.from_env(env)
    except ValueError as error:  # the runner's settings, srun among them
        return Probe("gpu-reset", "fail", "", _problem(error))
    node = _node_to_ask(env, resetter.runner, node, settings)
    what = f"{resetter.nvidia_smi} on {node or '?'} (runner {env.get('MEDIC_DCGM_RUNNER') or 'ssh'})"
    if node is None:
        return Probe("gpu-reset", "fail", what, "no node to ask: give --node NODE")
    done = resetter.runner.run(node, [resetter.nvidia_smi, *GPUS], PROBE_TIMEOUT_S)
    problem = _run_problem(done)
    if problem:
        return Probe("gpu-reset", "fail", what, problem)
    try:
        gpus = parse_gpus(done.stdout)
    except UnreadableOutputError as error:
        return Probe("gpu-reset", "fail", what, str(error))
    wider = scope(gpus, gpus[0].index)[1]
    takes = f"every GPU of the node together ({wider})" if wider else "one GPU at a time"
    return Probe("gpu-reset", "ok", what, f"{len(gpus)} GPUs; a reset takes {takes}")


def _run_problem(done: Any) -> str | None:
    if done.launch_error:
        return str(done.launch_error)
    if done.timed_out:
        return f"no answer within {PROBE_TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        said = " ".join((done.stderr + " " + done.stdout).split()) or "no message"
        return f"rc={done.returncode}: {said[:300]}"
    return None


# --- AWS, Slack, Prefect -------------------------------------------------------------------------


def probe_aws(env: Env) -> Probe:
    """STS GetCallerIdentity through boto3's standard credential chain."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    what = f"sts get-caller-identity ({region or 'default region'})"
    config = Config(
        connect_timeout=PROBE_TIMEOUT_S / 2,
        read_timeout=PROBE_TIMEOUT_S / 2,
        retries={"mode": "standard", "max_attempts": 1},
        user_agent_extra="gpu-medic-doctor",
    )
    try:
        client = boto3.session.Session(region_name=region).client(
            "sts", config=config, endpoint_url=env.get("AWS_ENDPOINT_URL_STS") or env.get("AWS_ENDPOINT_URL")
        )
        identity = client.get_caller_identity()
    except (BotoCoreError, ClientError) as error:
        return Probe("aws", "fail", what, _problem(error))
    return Probe("aws", "ok", what, f"account {identity['Account']} as {identity['Arn']}")


def probe_slack(env: Env) -> Probe:
    """auth.test with the configured token (SLACK_BOT_TOKEN or the Prefect Secret block)."""
    from slack_sdk import WebClient
    from slack_sdk.errors import SlackApiError

    from medic.integrations.slack.notifier import API_URL_ENV, DEFAULT_API_URL, token_from_env

    base_url = env.get(API_URL_ENV) or DEFAULT_API_URL
    what = base_url
    try:
        token = token_from_env(env)
    except Exception as error:  # the Secret block could not be read
        return Probe("slack", "fail", what, f"cannot read the token: {_problem(error)}")
    if not token:
        return Probe("slack", "fail", what, "no token: set SLACK_BOT_TOKEN or MEDIC_SLACK_TOKEN_BLOCK")
    client = WebClient(
        token=token, base_url=base_url.rstrip("/") + "/", timeout=int(PROBE_TIMEOUT_S), retry_handlers=[]
    )
    try:
        answer = client.auth_test()
    except SlackApiError as error:
        return Probe(
            "slack", "fail", what, f"auth.test: {error.response.get('error', error.response.status_code)}"
        )
    except OSError as error:
        return Probe("slack", "fail", what, f"auth.test: {_problem(error)}")
    team, user = answer.get("team"), answer.get("user")
    return Probe("slack", "ok", what, f"auth.test ok: team {team}, bot user {user}")


def probe_prefect(env: Env) -> Probe:
    """GET PREFECT_API_URL/health; without one the commands start a temporary local server."""
    import httpx

    url = env.get("PREFECT_API_URL") or _prefect_profile_url(env)
    dispatch = env.get("MEDIC_DISPATCH") or "local"
    if not url:
        if dispatch == "prefect":
            return Probe("prefect", "fail", "", "MEDIC_DISPATCH=prefect needs PREFECT_API_URL")
        return Probe("prefect", "skip", "", "embedded: no PREFECT_API_URL, each command starts its own")
    what = url
    try:
        response = httpx.get(url.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as error:
        return Probe("prefect", "fail", what, _problem(error) or type(error).__name__)
    if response.status_code != 200:
        return Probe("prefect", "fail", what, f"/health answered HTTP {response.status_code}")
    version = ""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        version = httpx.get(url.rstrip("/") + "/admin/version", timeout=PROBE_TIMEOUT_S).json()
    return Probe("prefect", "ok", what, "/health answered" + (f" (server {version})" if version else ""))


def probe_prefect_ui(env: Env) -> Probe:
    """The UI of the Prefect server at PREFECT_API_URL must send browsers to that same API: a server
    started on another port than 4200 without PREFECT_UI_API_URL serves a UI that cannot load a run."""
    import httpx

    api = env.get("PREFECT_API_URL") or _prefect_profile_url(env)
    if not api:
        return Probe("prefect-ui", "skip", "", "embedded: no server, no UI (`prefect server start` has one)")
    origin = api.rstrip("/").removesuffix("/api")
    try:
        response = httpx.get(origin + "/ui-settings", timeout=PROBE_TIMEOUT_S)
        settings = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as error:
        return Probe("prefect-ui", "fail", origin, _problem(error) or type(error).__name__)
    if not isinstance(settings, dict) or not settings.get("available_uis"):
        return Probe(
            "prefect-ui", "skip", origin, "this server serves no UI (Prefect Cloud, or the UI is off)"
        )
    shown = str(settings.get("api_url") or "")
    if _same_url(shown, api):
        return Probe("prefect-ui", "ok", origin, f"the UI reads runs from {shown}")
    return Probe(
        "prefect-ui",
        "fail",
        origin,
        f"the UI sends browsers to {shown or 'no API'}, not {api}: start the server with"
        f" PREFECT_UI_API_URL={api}",
    )


def _same_url(a: str, b: str) -> bool:
    def key(url: str) -> tuple[str, str, int | None, str]:
        parts = urlsplit(url.rstrip("/"))
        host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname or ""
        return parts.scheme, host, parts.port, parts.path

    return key(a) == key(b)


def _prefect_profile_url(env: Env) -> str | None:
    """PREFECT_API_URL from Prefect's own settings (its profile), when the environment has none.

    Prefect's settings cost over a second to import: only when the profiles file names the URL."""
    home = Path(env.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    profiles = Path(env.get("PREFECT_PROFILES_PATH") or home / "profiles.toml")
    try:
        if "PREFECT_API_URL" not in profiles.read_text(encoding="utf-8"):
            return None
    except OSError:
        return None
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def probe_checkpoints(location: str) -> Probe:
    what = location
    path = Path(location).expanduser()
    if not path.is_dir():
        return Probe("checkpoints", "fail", what, "not a directory")
    try:
        jobs = sum(1 for p in path.iterdir() if p.is_dir())
    except OSError as error:
        return Probe("checkpoints", "fail", what, f"cannot read: {error.strerror}")
    return Probe("checkpoints", "ok", what, f"readable, {jobs} job directories")


# --- all of them ---------------------------------------------------------------------------------


# --- Versions ------------------------------------------------------------------------------------

VERSION_TIMEOUT_S = 5.0


def _tool_version(command: list[str], pattern: str, env: Env) -> str:
    """What a tool on this machine says of its version: the pattern's group, else why not (Slurm's
    tools print theirs only once they find a configuration: SLURM_CONF)."""
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=VERSION_TIMEOUT_S, check=False, env=dict(env)
        )
    except FileNotFoundError:
        return "not found"
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unreadable ({error})"
    found = re.search(pattern, done.stdout, re.IGNORECASE | re.MULTILINE)
    if done.returncode != 0 or not found:
        said = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
        return f"unreadable (rc={done.returncode}: {said[:200]})"
    return found.group(1)


def versions(env: Env) -> dict[str, str]:
    """The versions `medic doctor` found: this package, its Prefect and store schema, and the Slurm
    and DCGM command-line tools on this machine (a remote node's DCGM: the dcgm probe)."""
    from medic.store.migrate import HEAD

    try:
        prefect = metadata.version("prefect")
    except metadata.PackageNotFoundError:
        prefect = "not installed (pip install 'gpu-medic[server]')"
    return {
        "gpu-medic": __version__,
        "store schema": HEAD,
        "prefect": prefect,
        # `sinfo --version` prints "slurm 22.05.8", or "slurm-wlm 22.05.8" from Debian's package (the real
        # one in tests/entrypoints/test_doctor.py).
        "slurm": _tool_version(["sinfo", "--version"], r"^slurm\S*\s+(\S+)", env),
        "dcgm": _tool_version([env.get("MEDIC_DCGMI") or "dcgmi", "--version"], DCGMI_VERSION, env),
    }


def probe_all(settings: Settings, node: str | None = None) -> list[Probe]:
    """Every probe, in a fixed order; `skip` for a system the configuration does not use."""
    env = settings.env
    chosen = {role: choice.value for role, choice in settings.backends.items()}
    uses_slurm = "slurm" in (chosen["scheduler"], chosen["provider"]) or (
        chosen["diagnostics"] == "dcgm" and env.get("MEDIC_DCGM_RUNNER") == "srun"
    )
    checkpoints = chosen["checkpoints"] or ""
    shown = {role: value or "unconfigured" for role, value in chosen.items()}
    uses_aws = chosen["provider"] in ("hyperpod", "ec2") or checkpoints.startswith("s3://")

    def unused(name: str, why: str) -> Callable[[], Probe]:
        return lambda: Probe(name, "skip", "", why)

    plan: list[Callable[[], Probe]] = [
        lambda: probe_store(settings.database_url),
        lambda: probe_policy(settings.policy_path),
        (lambda: probe_slurm(env))
        if uses_slurm
        else unused("slurm", f"not used (scheduler={shown['scheduler']}, provider={shown['provider']})"),
        (lambda: probe_dcgm(env, node, settings))
        if chosen["diagnostics"] == "dcgm"
        else unused("dcgm", f"not used (diagnostics={shown['diagnostics']})"),
        (lambda: probe_gpu_reset(env, node, settings))
        if env.get("MEDIC_GPU_RESET") == "nvidia-smi"
        else unused("gpu-reset", f"not used (MEDIC_GPU_RESET={env.get('MEDIC_GPU_RESET') or 'unset'})"),
        (lambda: probe_aws(env))
        if uses_aws
        else unused("aws", f"not used (provider={shown['provider']}, checkpoints={shown['checkpoints']})"),
        (lambda: probe_checkpoints(checkpoints))
        if checkpoints and checkpoints != "sim" and not checkpoints.startswith("s3://")
        else unused("checkpoints", f"no directory to read (checkpoints={shown['checkpoints']})"),
        (lambda: probe_slack(env))
        if chosen["notifier"] == "slack"
        else unused("slack", f"not used (notifier={shown['notifier']})"),
        lambda: probe_prefect(env),
        lambda: probe_prefect_ui(env),
    ]
    return [run() for run in plan]
