"""Leases: which process's run handles an incident, so that exactly one does.

A process that opens or picks up an incident holds its lease and renews it from a thread of its
own while the run goes on (a DCGM L3 can take 35 minutes; the lease must outlive no process).
When a process dies, its leases lapse within `MEDIC_LEASE_SECONDS` and the next pickup, in any
replica, claims the incident and runs it again from its last recorded step.

A runner is named "host:role:pid" (`medic serve` uses its port as the role). A restarted service
need not wait for its predecessor's leases to lapse: a runner of the same host and role whose
process is gone is dead, and its incidents are taken back at once.
"""

from __future__ import annotations

import logging
import os
import threading

from medic.store import Store
from medic.store.tables import IncidentRecord
from medic.tasks.runtime.runners import dead_runners, runner_name

# runner_name is named here too: the flows and `medic serve` name their leases' runners from here.
__all__ = ["DEFAULT_LEASE_S", "LEASE_ENV", "Leases", "lease_seconds", "runner_name"]

log = logging.getLogger("medic.leases")

LEASE_ENV = "MEDIC_LEASE_SECONDS"
DEFAULT_LEASE_S = 30.0


def lease_seconds() -> float:
    raw = os.environ.get(LEASE_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_LEASE_S
    except ValueError:
        raise ValueError(f"{LEASE_ENV}={raw!r} is not a number of seconds") from None
    if not 1 <= value <= 3600:
        raise ValueError(f"{LEASE_ENV}={raw!r}: give 1 to 3600 seconds")
    return value


class Leases:
    """The leases one process holds, renewed every third of their length until released."""

    def __init__(self, store: Store, runner: str, lease_s: float | None = None) -> None:
        self.store, self.runner = store, runner
        self.lease_s = lease_s if lease_s is not None else lease_seconds()
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, incident_id: str) -> None:
        """Renew this (already claimed) incident's lease from now on."""
        with self._lock:
            self._held.add(incident_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._renew, name="medic-leases", daemon=True)
                self._thread.start()

    def claim(self, incident_id: str) -> bool:
        """Take an incident no live run holds; True if this process now runs it."""
        if not self.store.claim_incident(incident_id, self.runner, self.lease_s, self.dead_runners()):
            return False
        self.hold(incident_id)
        return True

    def pickup(self) -> list[IncidentRecord]:
        """Claim every incident still being handled that no live run holds; returns those claimed."""
        dead = self.dead_runners()
        claimed = []
        for record in self.store.orphaned_incidents(dead):
            if record.id not in self.held() and self.store.claim_incident(
                record.id, self.runner, self.lease_s, dead
            ):
                self.hold(record.id)
                claimed.append(record)
        return claimed

    def dead_runners(self) -> set[str]:
        """Runners of this host and role whose process is gone (a predecessor killed mid-run)."""
        return dead_runners(self.store.incident_runners(), self.runner)

    def release(self, incident_id: str) -> None:
        with self._lock:
            self._held.discard(incident_id)

    def held(self) -> set[str]:
        with self._lock:
            return set(self._held)

    def close(self) -> None:
        """Stop renewing. What is still held lapses within a lease, for a replica's pickup."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=self.lease_s / 3)

    def _renew(self) -> None:
        """Renew what is held; the thread ends when nothing is (and `hold` starts another)."""
        while not self._stop.wait(self.lease_s / 3):
            with self._lock:
                held = set(self._held)
                if not held:
                    self._thread = None
                    return
            try:
                self.store.renew_leases(self.runner, held, self.lease_s)
            except Exception:  # the store is down: try again next time; the lease may lapse
                log.exception("renewing incident leases failed")
