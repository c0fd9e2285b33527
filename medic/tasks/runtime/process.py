"""What every task needs at hand: the store, the backends, and the policy in force.

One per process. The CLI and the tests install theirs with `configure`; a worker process that
runs a deployed flow builds one from the environment on first use, and refuses to with a backend
role unconfigured (`BackendNotConfiguredError`, naming each role and what to set): simulation is
chosen with MEDIC_BACKENDS=sim, never fallen back to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from medic.config import load_settings
from medic.integrations import registry
from medic.integrations.registry import Backends
from medic.policy import LoadedPolicy, PolicyError, load_policy
from medic.policy.approvers import Approvers, UserDirectory, is_email, resolve
from medic.policy.selectors import OTHER_NODES
from medic.store import Store, utcnow
from medic.tasks.runtime.fleet_snapshot import FleetNodes, Snapshot

log = logging.getLogger("medic.runtime")

# An approver email Slack could not be asked about is asked again no sooner than this.
APPROVER_RETRY_S = 60.0


@dataclass(frozen=True, slots=True)
class PolicyStatus:
    """How the last read of the policy file went, and which policy is in force."""

    path: str
    last_load_ok: bool
    sha256: str | None = None  # of the policy in force; None while none ever loaded
    in_force_since: datetime | None = None
    problem: str | None = None


class ApproverCache:
    """The policy's approvers as Slack user ids, each email looked up once per approver list.

    A lookup runs on a thread of its own when a policy with a new list loads, so neither an event
    nor a click waits on Slack for it; a click only waits (briefly) for one still under way.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[tuple[str, ...], UserDirectory | None] | None = None
        self._result: Approvers | None = None
        self._done = threading.Event()
        self._retry_at = 0.0

    def refresh(self, entries: list[str], directory: UserDirectory | None) -> None:
        """Start resolving `entries` unless they are resolved (or being resolved) already."""
        key = (tuple(entries), directory)
        with self._lock:
            same = self._key is not None and self._key[0] == key[0] and self._key[1] is directory
            if same and not (self._result is not None and self._result.retry):
                return
            if same and time.monotonic() < self._retry_at:
                return
            self._key, self._result, self._done = key, None, threading.Event()
            done = self._done
        if not any(map(is_email, entries)):
            self._finish(key, done, resolve(entries, directory))  # nothing to ask Slack
            return
        threading.Thread(
            target=lambda: self._finish(key, done, resolve(entries, directory)),
            name="medic-approvers",
            daemon=True,
        ).start()

    def get(self, entries: list[str], directory: UserDirectory | None, wait_s: float) -> Approvers:
        self.refresh(entries, directory)
        with self._lock:
            done = self._done
        done.wait(wait_s)
        with self._lock:
            if self._result is not None and self._key == (tuple(entries), directory):
                return self._result
        pending = tuple(f"{e}: not resolved yet, Slack is still being asked" for e in entries if is_email(e))
        return Approvers(frozenset(e for e in entries if not is_email(e)), pending, retry=True)

    def _finish(
        self, key: tuple[tuple[str, ...], UserDirectory | None], done: threading.Event, result: Approvers
    ) -> None:
        with self._lock:
            if self._key != key:
                return  # a newer list replaced it meanwhile
            self._result = result
            self._retry_at = time.monotonic() + APPROVER_RETRY_S
        for problem in result.problems:
            log.warning("approver %s; nobody is let in by it", problem)
        done.set()


@dataclass(slots=True)
class Runtime:
    store: Store
    backends: Backends
    policy_path: Path
    # Where the host evidence kept before a reboot or replacement is written (medic/tasks/nodes/host_evidence.py);
    # None: none is captured.
    artifact_root: Path | None = None
    _last_good: LoadedPolicy | None = field(default=None, repr=False)
    policy_problem: str | None = None
    _in_force_since: datetime | None = field(default=None, repr=False)
    _last_load_ok: bool | None = field(default=None, repr=False)
    _problem: str | None = field(default=None, repr=False)  # why the last read failed, if it did
    _said: str | None = field(default=None, repr=False)  # the state of the file logged last
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _approvers: ApproverCache = field(default_factory=ApproverCache, repr=False)
    _modes_of: str | None = field(default=None, repr=False)  # the policy whose modes were recorded
    _fleet: FleetNodes | None = field(default=None, repr=False)

    def fleet(self) -> Snapshot:
        """The scheduler's nodes, read at most every SNAPSHOT_S for this process's decisions
        (medic/tasks/runtime/fleet_snapshot.py); the guardrails add the drains recorded since it was read."""
        with self._lock:
            if self._fleet is None:
                self._fleet = FleetNodes(self.backends.scheduler.nodes)
        return self._fleet.get()

    def policy(self) -> LoadedPolicy:
        """Read the policy file now, so an edit applies to the next incident without a restart.

        A broken edit is refused: the last good policy stays in force and the problem is kept
        in `policy_problem` for the notification. Each change (an edit refused, the file loading
        again, another policy in force) is logged once, not at every read.
        """
        try:
            loaded = load_policy(self.policy_path)
        except PolicyError as error:
            with self._lock:
                self._last_load_ok = False
                if self._last_good is None:
                    self._problem = (
                        f"policy {self.policy_path} cannot be loaded and none is in force: {error}"
                    )
                    self._say(logging.ERROR, self._problem)
                    raise
                self.policy_problem = self._problem = (
                    f"policy edit refused, still using {self._last_good.sha256[:12]}: {error}"
                )
                self._say(logging.ERROR, self.policy_problem)
                return self._last_good
        with self._lock:
            refused = self._last_load_ok is False
            if self._last_good is None or self._last_good.sha256 != loaded.sha256:
                self._in_force_since = utcnow()
            self._last_good, self._last_load_ok = loaded, True
            self.policy_problem = self._problem = None
            again = "loads again: " if refused else ""
            self._say(
                logging.INFO,
                f"policy {loaded.path} {again}sha256 {loaded.sha256[:12]} in force",
                loaded.sha256,
            )
            record = self._modes_of != loaded.sha256
            self._modes_of = loaded.sha256
        if record:
            self._record_modes(loaded)
        self._approvers.refresh(loaded.policy.approvals.approvers, self._directory())
        return loaded

    def _record_modes(self, loaded: LoadedPolicy) -> None:
        """Put each mode the newly read policy changes in the audit trail (decision 0017), once per
        version of the file in this process, and in the store once whatever the number of replicas."""
        policy = loaded.policy
        modes = {OTHER_NODES: policy.mode.value, **{g.name: g.mode.value for g in policy.groups}}
        by = file_owner(self.policy_path)
        try:
            changed = self.store.record_modes(
                modes, by=by, policy_path=loaded.path, policy_sha256=loaded.sha256
            )
        except Exception as error:  # the store's trouble is every stage's; this one tries at the next read
            with self._lock:
                self._modes_of = None
            log.warning("mode changes of policy %s not recorded: %s", loaded.sha256[:12], error)
            return
        for row in changed:
            log.info(
                "nodes of %s now run in %s (were %s): policy %s by %s",
                "the policy" if row.node_group == OTHER_NODES else f"group {row.node_group}",
                row.mode or "the policy's mode (group removed)",
                row.previous or "in no group",
                loaded.sha256[:12],
                by,
            )

    def policy_status(self) -> PolicyStatus:
        """Read the policy file as an incident would, and say how it went; never raises."""
        with contextlib.suppress(PolicyError):  # said in the status
            self.policy()
        with self._lock:
            good = self._last_good
            return PolicyStatus(
                path=str(self.policy_path),
                last_load_ok=bool(self._last_load_ok),
                sha256=good.sha256 if good else None,
                in_force_since=self._in_force_since,
                problem=self._problem,
            )

    def approvers(self, wait_s: float = 2.0) -> Approvers:
        """Who may answer an approval under the policy in force, as Slack user ids, and why any
        listed approver is not among them. Waits at most `wait_s` for emails still being looked up."""
        entries = self.policy().policy.approvals.approvers
        return self._approvers.get(entries, self._directory(), wait_s)

    def _directory(self) -> UserDirectory | None:
        notifier = self.backends.notifier
        return notifier if isinstance(notifier, UserDirectory) else None

    def _say(self, level: int, text: str, state: str | None = None) -> None:
        """Log `text` once for each new state of the file (a problem, or the sha256 in force)."""
        state = state or text
        if state != self._said:
            self._said = state
            log.log(level, text)


def file_owner(path: Path | str) -> str:
    """Who a change of the policy file is put down to: its owner, else whoever runs GPU Medic."""
    try:
        return pwd.getpwuid(os.stat(path).st_uid).pw_name
    except (OSError, KeyError):
        return os.environ.get("USER") or "unknown"


_current: Runtime | None = None


def configure(runtime: Runtime) -> Runtime:
    global _current
    _current = runtime
    return runtime


def configured() -> Runtime | None:
    """The runtime installed in this process, without building one."""
    return _current


def current() -> Runtime:
    if _current is None:
        settings = load_settings()
        configure(
            Runtime(
                Store(settings.database_url),
                registry.from_settings(settings),
                settings.policy_path,
                settings.artifact_root,
            )
        )
    assert _current is not None
    return _current
