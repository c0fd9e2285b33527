"""Two `medic serve` replicas on one store, over a real Slurm cluster: the harness of
tests/system/test_replicas.py and scripts/bench_replicas.py (issue 14, item 9).

Every part is real: a PostgreSQL database of its own, a `prefect server` on PostgreSQL (the caller's:
the tests' `prefect_server` fixture, or tests/bench/prefect_server.py), a Slurm cluster of 20 nodes started by
scripts/slurm-cluster.sh in its own base and on its own ports (so it never meets tests/system/test_slurm.py's),
and two `medic serve --dispatch local` processes on two ports sharing the store, the Prefect API, the
Slurm cluster and one policy file. Faults are POSTed over HTTP, a replica is killed with SIGKILL and
started again with the same configuration.

What happened is read from the outside, never through the code under test: the store's tables with
plain SQL, and Slurm with `sinfo` and its own logs (slurmctld's "reboot request queued for nodes ...",
and the RebootProgram's reboots.log, one line per reboot the cluster carried out).

The three scenarios are functions returning their figures, so the tests assert on them and the
benchmark prints them:

- `duplicate_storm`: many XID 79s with new ids (and some ids sent to both replicas) for one node;
- `simultaneous_faults`: one XID 79 on each of many nodes at once, under `max_out_of_service`,
  with Slurm sampled every 100 ms throughout;
- `kill_storm`: kill -9 of a replica, again and again, while faults arrive on a dozen nodes;
- `kill_slot_holder`: kill -9 of the replica whose run holds the guardrail slot;
- `open_store_at_once`: the store opened by two processes at the same moment on an empty database.

The Slurm cluster lives under /tmp/medic-slurm-replicas (MEDIC_REPLICAS_SLURM_BASE to move it): one
harness at a time per machine, so the tests and scripts/bench_replicas.py do not run together.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import httpx
import yaml
from bench.prefect_server import fresh_database as bench_database
from checkout import REPO_ROOT
from factories import event_dict
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from medic.policy import load_policy
from medic.store.events import NO_INCIDENT_KINDS
from medic.store.migrate import VERSION_TABLE

T = TypeVar("T")
R = TypeVar("R", bound=tuple[Any, ...])
log = logging.getLogger("replicas")

TOKEN = "replicas-ingest-token"
NODE_COUNT = 20
SCRIPTS = REPO_ROOT / "scripts"
DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"
# Not under pytest's tmp_path: munged wants every directory above its socket searchable by all.
SLURM_BASE = Path(os.environ.get("MEDIC_REPLICAS_SLURM_BASE", "/tmp/medic-slurm-replicas"))
MEDIC = Path(sys.executable).parent / "medic"

# The store's incident statuses (medic/statuses.py), spelled out: the oracle does not import the product.
ACTIVE = ("open", "remediating", "waiting for approval")
TERMINAL = ("closed", "escalated")
DESTRUCTIVE = ("reboot", "reset_gpu", "replace")
NODE_ACTIONS_LIMIT = "medic-node-actions"  # the guardrail slot's Prefect global concurrency limit
# sinfo's long states (%T) of a node out of service: drained/draining, down, a reboot asked for or under
# way, failing, in maintenance, powering. What GPU Medic's max_out_of_service counts ("drained, down or
# rebooting, for any reason"), read from Slurm itself.
OUT_OF_SERVICE_WORDS = ("drain", "down", "reboot", "boot", "fail", "maint", "power")


def node_names(count: int, first: int = 1) -> list[str]:
    return [f"gpu-node-{i}" for i in range(first, first + count)]


def until(
    check: Callable[[], T | bool | None],
    what: str,
    timeout_s: float,
    describe: Callable[[], str] | None = None,
    interval_s: float = 0.2,
) -> T:
    """Poll `check` until it returns something truthy; at the deadline fail naming `what` and, when
    given, the state `describe` reports then."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        if time.monotonic() > deadline:
            now = f"; {describe()}" if describe else ""
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{now}")
        time.sleep(interval_s)
    return result  # type: ignore[return-value]  # truthy: not None, not False


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_port_block(count: int) -> int:
    """First of `count` consecutive ports free on 127.0.0.1 right now."""
    for _ in range(50):
        first = free_port()
        if first + count >= 65535:
            continue
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports")


# --- the store, read with plain SQL ---------------------------------------------------------------


def fresh_database(admin_url: str) -> contextlib.AbstractContextManager[str]:
    """A new PostgreSQL database for the replicas' store; dropped afterwards."""
    return bench_database(admin_url, "medic_replicas")


def _open_store(url: str, barrier: Any, answers: Any) -> None:
    from medic.store import Store

    barrier.wait()  # every process past its imports: they open the store at the same moment
    try:
        Store(url).close()
        answers.put("ok")
    except Exception as error:
        answers.put(f"{type(error).__name__}: {str(error).splitlines()[0]}")


def open_store_at_once(url: str, processes: int = 2) -> list[str]:
    """What `medic serve` does first at start, the store opened on `url`, by `processes` processes at the
    same moment (as replicas rolled out together do); how each ended: "ok" or its error's first line."""
    context = multiprocessing.get_context("spawn")
    barrier, answers = context.Barrier(processes), context.Queue()
    started = [context.Process(target=_open_store, args=(url, barrier, answers)) for _ in range(processes)]
    for process in started:
        process.start()
    outcome = [answers.get(timeout=60) for _ in started]
    for process in started:
        process.join(timeout=30)
    return sorted(outcome)


class IncidentRow(NamedTuple):
    id: str
    node: str
    status: str
    opened_at: datetime
    closed_at: datetime | None
    action: str | None
    outcome: str | None

    def describe(self) -> str:
        return f"{self.id} {self.node} {self.status} ({self.action or '-'}: {(self.outcome or '')[:160]})"


class ActionRow(NamedTuple):
    key: str
    incident_id: str
    node: str
    action: str
    status: str
    intent_at: datetime
    detail: str


class StoreView:
    """The store's tables as the replicas left them, read with SQL (no product code in the oracle)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: Engine = create_engine(url, pool_pre_ping=True)

    def _rows(self, sql: str, **params: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(text(sql), params))

    def ready(self) -> bool:
        """Whether the replicas have created the schema."""
        return bool(self._rows("SELECT to_regclass('public.incidents') IS NOT NULL")[0][0])

    def event_ids(self) -> set[str]:
        return {r[0] for r in self._rows("SELECT id FROM events")}

    def event_incidents(self) -> dict[str, str | None]:
        return {r[0]: r[1] for r in self._rows("SELECT id, incident_id FROM events")}

    def incident_spans(self) -> dict[str | None, tuple[int, datetime, datetime]]:
        """Per incident (None: no incident), its events: how many, first and last received."""
        return {
            r[0]: (int(r[1]), r[2], r[3])
            for r in self._rows(
                "SELECT incident_id, count(*), min(received_at), max(received_at) FROM events GROUP BY incident_id"
            )
        }

    def unattached(self, *, every_kind: bool = False) -> list[str]:
        """Stored events in no incident that belong in one: accepted, never handed on to remediation
        (what people did to a node, and a node's history, are no incident's: `NO_INCIDENT_KINDS`; nor
        is another event's evidence, `explained_by`). With `every_kind`, every event in no incident.
        Each as its id, kind, node and when it was received, for a failure's message."""
        kinds = ", ".join(f"'{k}'" for k in NO_INCIDENT_KINDS)  # the store's own constants, not input
        where = "" if every_kind else f"AND kind NOT IN ({kinds}) AND explained_by IS NULL"
        sql = f"SELECT id, kind, node, received_at FROM events WHERE incident_id IS NULL {where} ORDER BY received_at"
        return [f"{i} ({k}) on {n}, received {at:%H:%M:%S.%f}" for i, k, n, at in self._rows(sql)]

    def _select(self, row: type[R], table: str, order: str, node: str | None) -> list[R]:
        where = "WHERE node = :node" if node else ""
        sql = f"SELECT {', '.join(row._fields)} FROM {table} {where} ORDER BY {order}, id"
        return [row(*r) for r in self._rows(sql, node=node)]

    def incidents(self, node: str | None = None) -> list[IncidentRow]:
        return self._select(IncidentRow, "incidents", "opened_at", node)

    def actions(self, node: str | None = None) -> list[ActionRow]:
        return self._select(ActionRow, "actions", "intent_at", node)

    def threads(self, node: str) -> int:
        """Slack threads opened for the node's incidents: their delivered `notify` steps (a message each)."""
        sql = (
            "SELECT count(*) FROM steps s JOIN incidents i ON i.id = s.incident_id "
            "WHERE i.node = :node AND s.stage = 'notify' AND s.status = 'ok'"
        )
        return int(self._rows(sql, node=node)[0][0])

    def late_evidence(self, incident_id: str) -> int:
        """The incident's events the store received after it was closed or escalated."""
        sql = (
            "SELECT count(*) FROM events e JOIN incidents i ON i.id = e.incident_id "
            "WHERE i.id = :incident AND i.closed_at IS NOT NULL AND e.received_at > i.closed_at"
        )
        return int(self._rows(sql, incident=incident_id)[0][0])

    def untruthful_outcomes(self) -> list[str]:
        """Incidents whose outcome says the node was not touched though a node action of theirs succeeded."""
        sql = (
            "SELECT i.id, i.outcome FROM incidents i WHERE i.outcome LIKE '%not touched%' AND EXISTS "
            "(SELECT 1 FROM actions a WHERE a.incident_id = i.id AND a.status = 'succeeded') ORDER BY i.id"
        )
        return [f"{r[0]}: {r[1]}" for r in self._rows(sql)]

    def active(self) -> list[IncidentRow]:
        return [i for i in self.incidents() if i.status in ACTIVE]

    def truncate(self) -> None:
        """Empty every table (whatever tables the store has by now) but the schema's revision, for the
        next scenario: emptied, it would make the next start migrate tables that are there."""
        with self.engine.begin() as conn:
            tables = [
                r[0]
                for r in conn.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'"))
                if r[0] != VERSION_TABLE
            ]
            if tables:
                quoted = ", ".join(f'"{t}"' for t in tables)
                conn.execute(text(f"TRUNCATE {quoted} RESTART IDENTITY"))

    def close(self) -> None:
        self.engine.dispose()


def summarize(incidents: list[IncidentRow]) -> str:
    counts = Counter(i.status for i in incidents)
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no incidents"


# --- Slurm --------------------------------------------------------------------------------------------


@dataclass
class SlurmMarks:
    """Where Slurm's logs ended when a scenario began: what is after it is the scenario's."""

    ctld: int
    reboots: int


class SlurmCluster:
    """scripts/slurm-cluster.sh's cluster: `nodes` slurmd on 127.0.0.1 under `base`, on free ports."""

    def __init__(self, base: Path, nodes: int, gpus: int = 0, boot_delay_s: float = 10.0) -> None:
        self.base = base
        self.boot_delay_s = boot_delay_s
        self.nodes = node_names(nodes)
        ports = free_port_block(nodes + 1)
        self.env = {
            **os.environ,
            "SLURM_TEST_BASE": str(base),
            "SLURM_TEST_NODES": str(nodes),
            "SLURM_TEST_GPUS": str(gpus),
            "SLURM_TEST_CTLD_PORT": str(ports),
            "SLURM_TEST_NODE_PORT0": str(ports),  # node i listens on ports + i
            "SLURM_CONF": str(base / "etc" / "slurm.conf"),
        }
        self.conf = base / "etc" / "slurm.conf"
        self.ctld_log = base / "log" / "slurmctld.log"
        self.reboots_log = base / "log" / "reboots.log"

    def _script(self, command: str) -> None:
        subprocess.run(
            [str(SCRIPTS / "slurm-cluster.sh"), command],
            env=self.env,
            check=True,
            timeout=120,
            stdout=subprocess.DEVNULL,
        )

    @contextmanager
    def running(self) -> Iterator[SlurmCluster]:
        if shutil.which("slurmctld") is None:
            subprocess.run([str(SCRIPTS / "install-slurm.sh")], check=True, timeout=600)
        # A cluster left in this base by an interrupted run of this harness is stopped first.
        if (self.base / "run").exists():
            self._script("stop")
        self.base.mkdir(parents=True, exist_ok=True)
        self.base.chmod(0o755)
        self._script("start")
        try:
            self._slow_boots()
            yield self
        finally:
            # A reboot under way restarts its node's slurmd a moment later, after the stop if the stop
            # comes first: let reboots finish (a failed test may leave one), and end any straggler.
            with suppress(AssertionError, subprocess.SubprocessError):
                until(self._no_reboots, "reboots under way to finish", self.boot_delay_s + 20)
            self._script("stop")
            for pid in self._processes():
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(self.base, ignore_errors=True)

    def _no_reboots(self) -> bool:
        return not any("boot" in state for state in self.states().values())

    def _processes(self) -> list[int]:
        """This cluster's daemons still running: those started with its slurm.conf."""
        mine = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with suppress(OSError):
                if str(self.conf).encode() in cmdline.read_bytes().split(b"\0"):
                    mine.append(int(cmdline.parent.name))
        return mine

    def _slow_boots(self) -> None:
        """Make each reboot take `boot_delay_s` longer, as a real machine's does (minutes, in a fleet).

        The script's stand-in restarts a node's slurmd about a second after Slurm asks, so a
        remediation would be over within the ten seconds a duplicate burst lasts, and the burst's tail
        would rightly be a new incident. The RebootProgram slurm.conf names is wrapped: wait, then run
        the stand-in as slurmd would (its parent still slurmd, which is how it finds the node)."""
        if self.boot_delay_s <= 0:
            return
        program = self.base / "bin" / "fake-reboot"
        stand_in = program.with_name("fake-reboot-now")
        program.replace(stand_in)
        program.write_text(f'#!/bin/bash\nsleep {self.boot_delay_s:g}\nexec "{stand_in}" "$@"\n')
        program.chmod(0o755)

    def run(self, *args: str) -> str:
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, check=True, timeout=30)
        return done.stdout

    def states(self) -> dict[str, str]:
        """Each node's long state as sinfo prints it (idle, drained, reboot^, down*, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T")
        return dict(line.split(None, 1) for line in out.splitlines() if line.strip())

    @staticmethod
    def is_out(state: str) -> bool:
        return any(word in state.lower() for word in OUT_OF_SERVICE_WORDS)

    def out_of_service(self) -> frozenset[str]:
        return frozenset(n for n, s in self.states().items() if self.is_out(s))

    def mark(self) -> SlurmMarks:
        size = lambda p: p.stat().st_size if p.exists() else 0  # noqa: E731
        return SlurmMarks(size(self.ctld_log), size(self.reboots_log))

    def _since(self, path: Path, offset: int) -> list[str]:
        if not path.exists():
            return []
        with path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace").splitlines()

    def reboot_requests(self, since: SlurmMarks) -> list[str]:
        """The nodes of every `scontrol reboot` slurmctld queued since the mark, one entry per node."""
        nodes: list[str] = []
        for line in self._since(self.ctld_log, since.ctld):
            if "reboot request queued for nodes " in line:
                expression = line.rsplit("for nodes ", 1)[1].strip()
                nodes.extend(self.run("scontrol", "show", "hostnames", expression).split())
        return nodes

    def reboots(self, since: SlurmMarks) -> list[str]:
        """The nodes the cluster's RebootProgram rebooted since the mark, one entry per reboot."""
        return [
            parts[1]
            for line in self._since(self.reboots_log, since.reboots)
            if len(parts := line.split()) == 2 and parts[0].isdigit()
        ]

    def restore(self, timeout_s: float = 60) -> None:
        """Every node back to idle, whatever a scenario left (reboots under way are let finish)."""
        until(self._no_reboots, "reboots under way to finish", timeout_s, lambda: f"states: {self.states()}")
        for node, state in self.states().items():
            if self.is_out(state):
                self.run("scontrol", "update", f"nodename={node}", "state=resume")
        until(
            lambda: all(s == "idle" for s in self.states().values()),
            "every Slurm node idle",
            timeout_s,
            lambda: f"states: {self.states()}",
        )


class OutOfServiceSampler:
    """Samples which nodes Slurm shows out of service, every `interval_s`, on a thread of its own; keeps
    the most seen at once, every node ever seen out, and each sample with more than `limit` out."""

    def __init__(self, slurm: SlurmCluster, interval_s: float = 0.1, limit: int | None = None) -> None:
        self.slurm = slurm
        self.interval_s = interval_s
        self.limit = limit
        self.samples = 0
        self.errors: list[str] = []
        self.max_out: frozenset[str] = frozenset()
        self.max_at: float = 0.0
        self.ever_out: set[str] = set()
        self.over: list[tuple[float, frozenset[str]]] = []  # (seconds in, nodes out) above `limit`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="out-of-service-sampler", daemon=True)
        self._started = 0.0

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                out = self.slurm.out_of_service()
            except (subprocess.SubprocessError, OSError) as error:
                self.errors.append(f"{type(error).__name__}: {error}")
            else:
                self.samples += 1
                self.ever_out |= out
                at = began - self._started
                if len(out) > len(self.max_out):
                    self.max_out, self.max_at = out, at
                if self.limit is not None and len(out) > self.limit:
                    self.over.append((at, out))
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def __enter__(self) -> OutOfServiceSampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# --- the replicas ------------------------------------------------------------------------------------


def write_policy(path: Path, *, max_out_of_service: int) -> None:
    """policies/default.yaml with guardrails that let races show: `max_out_of_service` nodes at once,
    counted from the scheduler; no node cooldown, no hourly cap and no circuit breaker, so that nothing
    but the store's and the slot's own guarantees stands between two replicas and a second action. No
    approvals either: an incident waiting an hour for a human would hide what happened after it."""
    policy = yaml.safe_load(DEFAULT_POLICY.read_text(encoding="utf-8"))
    policy["approvals"] = {"required_for": []}  # a human's answer is no part of any race here
    policy["guardrails"] = {
        "max_out_of_service": max_out_of_service,
        "count_out_of_service_by_others": True,
        "node_cooldown_minutes": 0,
        "never_touch": [],
    }
    written = path.with_suffix(".tmp")
    written.write_text(yaml.safe_dump(policy, sort_keys=False), encoding="utf-8")
    load_policy(written)  # the keys are the model's (medic/policy/model.py): refused here, not in a run
    written.replace(path)  # the replicas re-read the file per incident: never see it half written


@dataclass
class Replica:
    """One `medic serve --dispatch local` process; started again with the same environment after a kill."""

    name: str
    port: int
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0
    _launched: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def launch(self) -> None:
        """Start the process (not waiting for it: see `ready`)."""
        assert not self.alive(), f"replica {self.name} is already running"
        self.starts += 1
        self._launched = time.monotonic()
        with self.log.open("ab") as output:
            output.write(
                f"\n=== start {self.starts} of replica {self.name} at {datetime.now(UTC)} ===\n".encode()
            )
            output.flush()
            command = [str(MEDIC), "serve", "--dispatch", "local", "--port", str(self.port)]
            self.process = subprocess.Popen(
                [*command, "--log-level", "warning", "--no-access-log"],
                env=self.env,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=self.log.parent,
            )

    def ready(self, timeout_s: float = 90) -> float:
        """Wait for /healthz to answer 200; return the seconds since `launch`."""
        assert self.process is not None
        deadline = self._launched + timeout_s
        while True:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"replica {self.name} exited with {self.process.returncode} at start:\n{self.tail()}"
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return time.monotonic() - self._launched
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"replica {self.name} did not answer /healthz in {timeout_s:.0f} s")
            time.sleep(0.05)

    def start(self, timeout_s: float = 90) -> float:
        """Start the process; return the seconds until /healthz answered 200."""
        self.launch()
        return self.ready(timeout_s)

    def kill9(self) -> None:
        if not self.alive():
            return
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.kills += 1

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"


class Acks:
    """Which event ids a replica acknowledged (a 2xx answer naming them accepted or duplicate)."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.posts = 0
        self.answered: Counter[int] = Counter()
        self.failed: Counter[str] = Counter()  # no answer: refused, cut off by a kill, timed out
        self._lock = threading.Lock()

    def note(self, events: list[dict[str, Any]], response: httpx.Response | None, error: str | None) -> None:
        with self._lock:
            self.posts += 1
            if response is None:
                self.failed[error or "?"] += 1
                return
            self.answered[response.status_code] += 1
            if response.is_success:
                rejected = {r.get("index") for r in response.json().get("rejected", [])}
                self.ids.update(e["id"] for i, e in enumerate(events) if i not in rejected)


class Harness:
    """The store, the Slurm cluster, the policy file and two replicas, with what scenarios share."""

    def __init__(
        self, workdir: Path, database_url: str, prefect_api_url: str, slurm: SlurmCluster, replicas: int = 2
    ) -> None:
        self.workdir = workdir
        self.prefect_api_url = prefect_api_url
        self.store = StoreView(database_url)
        self.slurm = slurm
        self.policy = workdir / "policy.yaml"
        write_policy(self.policy, max_out_of_service=len(slurm.nodes))
        self.replicas: list[Replica] = []
        for name in "AB"[:replicas]:
            home = workdir / f"replica-{name}"
            home.mkdir(parents=True, exist_ok=True)
            env = {
                key: value
                for key, value in os.environ.items()
                if not key.startswith(("MEDIC_", "SLACK_", "PREFECT_", "SLURM_"))
            }
            env |= {
                "MEDIC_HOME": str(home),
                "MEDIC_DATABASE_URL": database_url,
                "MEDIC_INGEST_TOKENS": TOKEN,
                "MEDIC_POLICY": str(self.policy),
                "MEDIC_SCHEDULER": "slurm",
                "MEDIC_PROVIDER": "slurm",
                "MEDIC_BACKENDS": "sim",  # diagnostics, checkpoints, notifier
                "MEDIC_SIM_NODES": str(len(slurm.nodes)),  # the simulated diagnostics know gpu-node-1..N
                "SLURM_CONF": str(slurm.conf),
                "PREFECT_API_URL": prefect_api_url,
                "PREFECT_HOME": str(home / "prefect"),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            }
            self.replicas.append(Replica(name, free_port(), env, home / "serve.log"))
        self.clients = [
            httpx.Client(base_url=r.url, timeout=15, headers={"Authorization": f"Bearer {TOKEN}"})
            for r in self.replicas
        ]

    @classmethod
    @contextmanager
    def running(
        cls, workdir: Path, admin_url: str, prefect_api_url: str, nodes: int = NODE_COUNT
    ) -> Iterator[Harness]:
        with (
            fresh_database(admin_url) as database_url,
            SlurmCluster(SLURM_BASE, nodes).running() as slurm,
        ):
            harness = cls(workdir, database_url, prefect_api_url, slurm)
            try:
                # One after the other: the first creates the schema. Both at once on an empty database
                # is a race of its own (`open_store_at_once`).
                for replica in harness.replicas:
                    replica.start()
                until(harness.store.ready, "the replicas to create the store's tables", 30)
                yield harness
            finally:
                for replica in harness.replicas:
                    replica.stop()
                for client in harness.clients:
                    client.close()
                harness.store.close()

    def start_all(self) -> None:
        """Start every replica that is not running, at once."""
        stopped = [r for r in self.replicas if not r.alive()]
        for replica in stopped:
            replica.launch()
        for replica in stopped:
            replica.ready()

    # --- between scenarios ---

    def reset(self, *, max_out_of_service: int, settle_s: float = 30) -> SlurmMarks:
        """A clean start for a scenario: every Slurm node idle, the store empty, both replicas up, the
        scenario's policy in force. When the last scenario left work unfinished (it failed on that), both
        replicas are killed first, so that none of its runs acts during the next one, and the guardrail
        slot's limit is deleted, so that no lease a killed run held outlives it (the replicas started
        next create the limit again)."""
        self.start_all()
        try:
            self.settle(settle_s)
        except AssertionError:
            for replica in self.replicas:
                replica.kill9()
            httpx.delete(f"{self.prefect_api_url}/v2/concurrency_limits/{NODE_ACTIONS_LIMIT}", timeout=10)
        self.slurm.restore()
        self.store.truncate()
        write_policy(self.policy, max_out_of_service=max_out_of_service)
        self.start_all()
        return self.slurm.mark()

    def settled(self) -> bool:
        return not self.store.active() and not self.store.unattached()

    def slot_taken(self) -> int | None:
        """How many holders the `medic-node-actions` global concurrency limit (medic/tasks/nodes/guard.py) counts
        now, as Prefect's API says; None when it cannot be read (not created yet)."""
        try:
            answer = httpx.get(
                f"{self.prefect_api_url}/v2/concurrency_limits/{NODE_ACTIONS_LIMIT}", timeout=5
            )
            return int(answer.json()["active_slots"]) if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def describe(self) -> str:
        incidents = self.store.incidents()
        active = [i.describe() for i in incidents if i.status in ACTIVE]
        out = {n: s for n, s in self.slurm.states().items() if s != "idle"}
        return (
            f"incidents: {summarize(incidents)}; still active: {active[:12]}; "
            f"events in no incident: {self.store.unattached(every_kind=True)[:8]}; Slurm nodes not idle: {out or 'none'}; "
            f"{NODE_ACTIONS_LIMIT} slots taken: {self.slot_taken()}"
        )

    def settle(self, timeout_s: float) -> float:
        """Wait until no incident is being handled and every stored event is in one; return how long."""
        began = time.monotonic()
        until(self.settled, "every incident to finish", timeout_s, self.describe, interval_s=0.25)
        return time.monotonic() - began

    def try_settle(self, timeout_s: float) -> tuple[float | None, str | None]:
        """`settle`, as (seconds, None), or (None, what was still unfinished) at the deadline."""
        try:
            return self.settle(timeout_s), None
        except AssertionError as error:
            return None, str(error)

    # --- posting ---

    def post(self, replica: int, events: list[dict[str, Any]], acks: Acks, retry_s: float = 0.0) -> bool:
        """POST `events` to one replica. With `retry_s`, as a client that knows both: when that one does
        not answer, the other, and so on every 0.3 s until one answers or `retry_s` has passed."""
        deadline = time.monotonic() + retry_s
        index = replica
        while True:
            try:
                response = self.clients[index].post(
                    "/v1/events", json=events if len(events) > 1 else events[0]
                )
            except httpx.HTTPError as error:
                acks.note(events, None, type(error).__name__)
                if time.monotonic() >= deadline:
                    return False
                index = 1 - index
                time.sleep(0.3)
                continue
            acks.note(events, response, None)
            return response.is_success


def xid79(
    event_id: str, node: str, gpu: int = 0, source: str = "dcgm-exporter", ago_s: float = 0.0
) -> dict[str, Any]:
    return event_dict(
        id=event_id,
        node=node,
        gpu=gpu,
        source=source,
        at=datetime.now(UTC) - timedelta(seconds=ago_s),
        code=79,
    )


# --- (a) duplicates for one node ---------------------------------------------------------------------


@dataclass
class DuplicateStorm:
    node: str
    events: int
    sent_to_both: int
    posted_s: float
    acks: Acks
    stored: set[str]
    lost: set[str]  # acknowledged, not stored
    incidents: list[IncidentRow]
    events_by_incident: dict[str | None, int]
    destructive: list[ActionRow]  # the store's reboot/reset_gpu/replace rows for the node
    threads: int  # Slack threads opened for the node's incidents
    late: int  # events of the node's first incident received after it ended
    slurm_requests: int
    slurm_reboots: int
    settle_s: float | None  # from the last POST until everything finished; None: it never did
    settle_problem: str | None
    began_at: datetime  # the first POST
    spans: dict[str | None, tuple[int, datetime, datetime]]
    took_s: float

    def timeline(self) -> str:
        """Each incident of the node against the first POST: opened, closed, its events' arrivals."""
        at = lambda t: f"{(t - self.began_at).total_seconds():+.1f} s" if t else "-"  # noqa: E731
        lines = []
        for i in self.incidents:
            count, first, last = self.spans.get(i.id, (0, None, None))
            lines.append(
                f"{i.id} opened {at(i.opened_at)} closed {at(i.closed_at)} {i.status} ({i.action or '-'}), "
                f"{count} events received {at(first)}..{at(last)}"
            )
        return "; ".join(lines)


def duplicate_storm(
    h: Harness,
    node: str = "gpu-node-7",
    events: int = 200,
    spread_s: float = 10.0,
    both_every: int = 5,
    settle_s: float = 120,
) -> DuplicateStorm:
    """`events` XID 79s with new ids for one node, spread over `spread_s`, alternating between the
    replicas; every `both_every`-th id is sent to both replicas at the same moment. Near-duplicates:
    the GPU, the source and a few hundred ms of event time vary."""
    marks = h.reset(max_out_of_service=len(h.slurm.nodes))
    run = uuid.uuid4().hex[:6]
    acks = Acks()
    sources = itertools.cycle(["dcgm-exporter", "kernel-log", "medic-agent"])
    rng = random.Random(14)
    log.info("duplicate storm: %d XID 79s for %s over %.0f s", events, node, spread_s)
    began, began_at = time.monotonic(), datetime.now(UTC)
    with ThreadPoolExecutor(8) as pool:
        futures: list[Future[bool]] = []
        for i in range(events):
            time.sleep(max(0.0, began + i * spread_s / events - time.monotonic()))
            event = xid79(
                f"dup-{run}-{i:03d}", node, gpu=i % 8, source=next(sources), ago_s=rng.uniform(0, 0.5)
            )
            targets = [0, 1] if i % both_every == 0 else [i % 2]
            futures.extend(pool.submit(h.post, t, [event], acks) for t in targets)
        for future in futures:
            future.result()
    posted_s = time.monotonic() - began
    log.info("duplicate storm: posted in %.1f s; waiting for the incidents to finish", posted_s)
    took, problem = h.try_settle(settle_s)
    log.info("duplicate storm: settled %s s after the last POST", took and f"{took:.1f}")
    by_incident = Counter(h.store.event_incidents().values())
    return DuplicateStorm(
        node=node,
        events=events,
        sent_to_both=len(range(0, events, both_every)),
        posted_s=posted_s,
        acks=acks,
        stored=(stored := h.store.event_ids()),
        lost=acks.ids - stored,
        incidents=h.store.incidents(node),
        events_by_incident=dict(by_incident),
        destructive=[a for a in h.store.actions(node) if a.action in DESTRUCTIVE],
        threads=h.store.threads(node),
        late=sum(h.store.late_evidence(i.id) for i in h.store.incidents(node)),
        slurm_requests=h.slurm.reboot_requests(marks).count(node),
        slurm_reboots=h.slurm.reboots(marks).count(node),
        settle_s=took,
        settle_problem=problem,
        began_at=began_at,
        spans=h.store.incident_spans(),
        took_s=time.monotonic() - began,
    )


# --- (b) many nodes at once under max_out_of_service --------------------------------------------------


@dataclass
class SimultaneousFaults:
    nodes: list[str]
    limit: int
    posted_s: float
    acks: Acks
    lost: set[str]
    samples: int
    sample_errors: list[str]
    max_out: frozenset[str]
    max_out_at_s: float
    over_limit: list[tuple[float, frozenset[str]]]
    ever_out: set[str]
    incidents: list[IncidentRow]
    settle_s: float | None  # from the last POST until everything finished; None: it never did
    settle_problem: str | None
    took_s: float


def simultaneous_faults(
    h: Harness, count: int = NODE_COUNT, within_s: float = 4.0, limit: int = 2, settle_s: float = 150
) -> SimultaneousFaults:
    """One XID 79 on each of `count` nodes within `within_s`, alternating replicas, under
    `max_out_of_service: limit`; Slurm sampled every 100 ms from before the first POST until every
    incident finished."""
    h.reset(max_out_of_service=limit)
    nodes = node_names(count)
    run = uuid.uuid4().hex[:6]
    acks = Acks()
    log.info("simultaneous faults: %d nodes within %.0f s, max_out_of_service %d", count, within_s, limit)
    with OutOfServiceSampler(h.slurm, limit=limit) as sampler:
        began = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            futures = []
            for i, node in enumerate(nodes):
                time.sleep(max(0.0, began + i * within_s / count - time.monotonic()))
                futures.append(pool.submit(h.post, i % 2, [xid79(f"sim-{run}-{i:02d}", node)], acks))
            for future in futures:
                future.result()
        posted_s = time.monotonic() - began
        took, problem = h.try_settle(settle_s)
        log.info("simultaneous faults: settled %s s after the last POST", took and f"{took:.1f}")
    return SimultaneousFaults(
        nodes=nodes,
        limit=limit,
        posted_s=posted_s,
        acks=acks,
        lost=acks.ids - h.store.event_ids(),
        samples=sampler.samples,
        sample_errors=sampler.errors,
        max_out=sampler.max_out,
        max_out_at_s=sampler.max_at,
        over_limit=sampler.over,
        ever_out=sampler.ever_out,
        incidents=h.store.incidents(),
        settle_s=took,
        settle_problem=problem,
        took_s=time.monotonic() - began,
    )


# --- (c) kill -9 mid-flow -----------------------------------------------------------------------------


@dataclass
class Kill:
    replica: str
    at_s: float  # since the first fault
    active: int  # incidents being handled when it was killed
    slot_taken: int | None  # the guardrail slot's holders (any replica's) just before the kill
    restart_s: float = 0.0  # from the new process's start until it answered /healthz


@dataclass
class KillStorm:
    nodes: list[str]
    kills: list[Kill]
    acks: Acks
    stored: int
    lost: set[str]
    settle_s: float | None  # from the last restart until everything finished; None: it never did
    settle_problem: str | None
    incidents: list[IncidentRow]
    unattached: list[str]  # events in no incident that belong in one (StoreView.unattached)
    untruthful: list[str]  # outcomes saying "not touched" of a node their incident acted on
    taken_out: set[str]  # nodes Slurm showed out of service at some point, or the store says we acted on
    final_states: dict[str, str]
    latest: dict[str, IncidentRow]  # each node's latest incident
    reboots_in_store: Counter[str]  # per node: reboot/reset_gpu/replace rows
    reboots_in_slurm: Counter[str]  # per node: reboots the cluster carried out
    took_s: float


def kill_storm(
    h: Harness,
    kills: int = 20,
    count: int = 12,
    events_per_node: int = 8,
    burst_s: float = 2.0,
    settle_s: float = 120,
    seed: int = 14,
) -> KillStorm:
    """Faults arrive on `count` nodes (a burst of `events_per_node` XID 79s each, node after node,
    spread over the whole run) while a replica is killed with SIGKILL `kills` times, alternately A and B.

    Each kill waits for an incident to be in progress and then a random moment more (0-1.5 s, seeded),
    so kills land at every stage of a run; the killed replica is started again at once with the same
    configuration, in the background, and is not killed again before it answers. The other replica
    may be starting meanwhile, so for a moment neither may answer: clients post to one replica, then
    to the other, and retry for up to 15 s, as an agent would; only a 2xx answer counts as acknowledged."""
    marks = h.reset(max_out_of_service=count)
    nodes = node_names(count)
    run = uuid.uuid4().hex[:6]
    acks = Acks()
    rng = random.Random(seed)
    record: list[Kill] = []
    counter = itertools.count()

    def burst(node: str) -> None:
        for k in range(events_per_node):
            i = next(counter)
            h.post(i % 2, [xid79(f"kill-{run}-{node}-{k}", node, gpu=k % 8)], acks, retry_s=15)
            time.sleep(burst_s / events_per_node)

    # Node k's burst starts before kill number k * kills / count: faults keep arriving throughout.
    starts: dict[int, list[str]] = defaultdict(list)
    for k, node in enumerate(nodes):
        starts[round(k * kills / count)].append(node)
    began = time.monotonic()
    restarting: dict[str, tuple[Kill, Future[float]]] = {}
    with (
        OutOfServiceSampler(h.slurm, interval_s=0.5) as sampler,
        ThreadPoolExecutor(count + len(h.replicas)) as pool,
    ):
        bursts = []
        for n in range(kills):
            bursts.extend(pool.submit(burst, node) for node in starts.get(n, []))
            victim = h.replicas[n % len(h.replicas)]
            if victim.name in restarting:  # its last restart must have answered before it dies again
                kill, restart = restarting.pop(victim.name)
                kill.restart_s = restart.result()
            with suppress(AssertionError):
                until(lambda: h.store.active(), "an incident in progress", 5, interval_s=0.05)
            time.sleep(rng.uniform(0.0, 1.5))
            kill = Kill(victim.name, time.monotonic() - began, len(h.store.active()), h.slot_taken())
            log.info(
                "kill storm: kill -9 %d of replica %s, %d incidents active, slot taken %s",
                *(n + 1, victim.name, kill.active, kill.slot_taken),
            )
            victim.kill9()
            restarting[victim.name] = (kill, pool.submit(victim.start))
            record.append(kill)
        for kill, restart in restarting.values():
            kill.restart_s = restart.result()
        last_restart = time.monotonic()
        for b in bursts:
            b.result()
        log.info(
            "kill storm: %d kills in %.1f s; waiting for the incidents to finish", kills, last_restart - began
        )
        took, problem = h.try_settle(settle_s - (time.monotonic() - last_restart))
        if took is not None:
            took = time.monotonic() - last_restart
        log.info("kill storm: settled %s s after the last restart", took and f"{took:.1f}")
    incidents = h.store.incidents()
    latest: dict[str, IncidentRow] = {}
    for incident in incidents:  # ordered by opening
        latest[incident.node] = incident
    actions = h.store.actions()
    stored = h.store.event_ids()
    return KillStorm(
        nodes=nodes,
        kills=record,
        acks=acks,
        stored=len(stored),
        lost=acks.ids - stored,
        settle_s=took,
        settle_problem=problem,
        incidents=incidents,
        unattached=h.store.unattached(),
        untruthful=h.store.untruthful_outcomes(),
        taken_out=sampler.ever_out | {a.node for a in actions if a.action in (*DESTRUCTIVE, "drain")},
        final_states=h.slurm.states(),
        latest=latest,
        reboots_in_store=Counter(a.node for a in actions if a.action in DESTRUCTIVE),
        reboots_in_slurm=Counter(h.slurm.reboots(marks)),
        took_s=time.monotonic() - began,
    )


def left_out(result: KillStorm) -> dict[str, str]:
    """Nodes taken out that are neither back in service nor held by an escalated incident: node → why."""
    wrong = {}
    for node in sorted(result.taken_out):
        state = result.final_states.get(node, "?")
        if not SlurmCluster.is_out(state):
            continue
        incident = result.latest.get(node)
        if incident is None or incident.status != "escalated":
            wrong[node] = f"Slurm {state}; latest incident: {incident.describe() if incident else 'none'}"
    return wrong


# --- (d) kill -9 of the replica holding the guardrail slot ---------------------------------------------


@dataclass
class SlotHolderKill:
    attempts: int  # faults posted until a kill landed while the slot was held
    held_after_kill: bool  # the slot still counted its (dead) holder right after the kill
    other_node: str
    blocked_s: float | None  # from the kill until the other replica's first action on its node; None: none
    bound_s: float
    other_actions: list[ActionRow]
    slot_now: int | None


def kill_slot_holder(h: Harness, bound_s: float = 60.0, attempts: int = 3) -> SlotHolderKill:
    """Kill -9 replica A while its run holds the `medic-node-actions` slot (a fault on a node of its own,
    the slot polled every 10 ms until it is held, then the kill), start A again, and post a fault for
    another node to B: how long B's run waits before it may act on its node."""
    h.reset(max_out_of_service=len(h.slurm.nodes))
    acks = Acks()
    run = uuid.uuid4().hex[:6]
    holder = h.replicas[0]
    held, tried = False, 0
    while not held and tried < attempts:
        tried += 1
        h.post(0, [xid79(f"slot-{run}-{tried}", f"gpu-node-{tried}")], acks)
        with suppress(AssertionError):
            until(lambda: h.slot_taken() == 1, "the guardrail slot to be held", 30, interval_s=0.01)
        holder.kill9()
        held = h.slot_taken() == 1
        if not held:  # it let go between the look and the kill: again, on another node
            holder.start()
            h.settle(60)
    log.info("slot holder kill: %s after %d attempts", "held" if held else "never held", tried)
    killed_at = datetime.now(UTC)
    with ThreadPoolExecutor(1) as pool:
        restarted = pool.submit(holder.start)
        other = f"gpu-node-{len(h.slurm.nodes)}"
        h.post(1, [xid79(f"slot-{run}-other", other)], acks, retry_s=15)
        with suppress(AssertionError):
            until(lambda: h.store.actions(other), f"an action on {other}", bound_s, interval_s=0.1)
        acted = h.store.actions(other)
        restarted.result()
    blocked = (min(r.intent_at for r in acted) - killed_at).total_seconds() if acted else None
    return SlotHolderKill(tried, held, other, blocked, bound_s, acted, h.slot_taken())


def dump(value: Any) -> str:
    """A result as JSON (sets sorted, datetimes as text), for a benchmark's record."""
    return json.dumps(
        value, default=lambda v: sorted(v) if isinstance(v, set | frozenset) else str(v), indent=1
    )
