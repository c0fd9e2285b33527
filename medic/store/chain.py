"""The audit chain's arithmetic: which tables it seals, a row's digest, an entry's hash, and the walk
that checks entries link (docs/store.md#tamper-evidence). No I/O: the ledger (medic/store/ledger.py)
writes entries, verify and the archive read them back.

A row's digest is the SHA-256 of its canonical JSON. An entry's hash covers the entry, the hash of
the entry before it in the store (the global chain) and the hash of the entry before it for the same
incident (the incident's chain): SHA-256, or HMAC-SHA256 under MEDIC_AUDIT_KEY, so that someone who
can edit the database but does not hold the key cannot recompute the chain after an edit.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

# The hash before the first entry.
GENESIS = "0" * 64


@dataclass(frozen=True, slots=True)
class Audited:
    """A table whose every written row is sealed by an entry. Its primary key is `id`."""

    table: str
    incident: str | None  # the column naming the incident whose chain the row is in; None: none
    # Columns left out of the digest: bookkeeping that changes without anything happening (a run's
    # lease is renewed every few seconds), which would otherwise fill the ledger.
    excluded: frozenset[str] = frozenset()


# In the order rows are sealed when a store is first chained (migration 0002).
AUDITED: dict[str, Audited] = {
    spec.table: spec
    for spec in (
        Audited("incidents", "id", frozenset({"runner", "lease_until"})),
        Audited("events", "incident_id"),
        Audited("steps", "incident_id"),
        Audited("diagnostics", "incident_id"),
        Audited("decisions", "incident_id"),
        Audited("actions", "incident_id"),
        Audited("approvals", "incident_id"),
        # A fleet-wide fact: kept when the incident that opened it is pruned, so in no incident's chain.
        Audited("breaker", None),
        Audited("audit_prunes", None),
        Audited("mode_changes", None),  # fleet-wide, like the breaker (decision 0017)
    )
}


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):  # the store's times are UTC (medic.store.types.UTCDateTime)
        return (value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)).isoformat()
    raise TypeError(f"not JSON: {type(value).__name__}")


def canonical(values: Mapping[str, Any]) -> bytes:
    """One byte string per content: keys sorted, no spaces, ASCII, times in UTC. A row read from the
    store and the same row read from an archive (times already strings) give the same bytes."""
    return json.dumps(values, sort_keys=True, separators=(",", ":"), default=_jsonable).encode()


def jsonable(values: Mapping[str, Any]) -> dict[str, Any]:
    """The row as an archive keeps it."""
    loaded: dict[str, Any] = json.loads(canonical(values))
    return loaded


def row_digest(spec: Audited, row: Mapping[Any, Any]) -> str:
    """The digest of a row's content. Empty (NULL) columns are left out, so that a nullable column a
    later revision adds leaves the digests of the rows sealed before it as they were."""
    content = {name: value for name, value in row.items() if name not in spec.excluded and value is not None}
    return hashlib.sha256(canonical(content)).hexdigest()


@dataclass(frozen=True)
class ChainKey:
    """MEDIC_AUDIT_KEY. Entries name the key they were made with by its id, never the key."""

    secret: bytes

    @cached_property
    def id(self) -> str:
        return hmac.new(self.secret, b"medic audit key id", hashlib.sha256).hexdigest()[:16]

    def sign(self, message: bytes) -> str:
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    @classmethod
    def of(cls, secret: str | None) -> ChainKey | None:
        return cls(secret.encode()) if secret else None


@dataclass(frozen=True, slots=True)
class Entry:
    """One row of `audit_chain`: this row of this table had this digest (None: it was deleted)."""

    seq: int
    at: datetime
    table: str
    row_key: str
    incident_id: str | None
    digest: str | None
    prev_hash: str
    incident_prev_hash: str | None  # None: the incident's first entry, or no incident
    key_id: str | None
    hash: str = ""

    def message(self) -> bytes:
        return json.dumps(
            [
                self.seq,
                self.at.astimezone(UTC).isoformat(),
                self.table,
                self.row_key,
                self.incident_id,
                self.digest,
                self.prev_hash,
                self.incident_prev_hash,
                self.key_id,
            ],
            separators=(",", ":"),
        ).encode()

    def computed_hash(self, key: ChainKey | None) -> str:
        if key is None:
            return hashlib.sha256(self.message()).hexdigest()
        return key.sign(self.message())

    def values(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "at": self.at,
            "table_name": self.table,
            "row_key": self.row_key,
            "incident_id": self.incident_id,
            "digest": self.digest,
            "prev_hash": self.prev_hash,
            "incident_prev_hash": self.incident_prev_hash,
            "key_id": self.key_id,
            "hash": self.hash,
        }

    @classmethod
    def of(cls, row: Mapping[Any, Any]) -> Entry:
        at = row["at"]
        return cls(
            seq=row["seq"],
            at=datetime.fromisoformat(at) if isinstance(at, str) else at,
            table=row["table_name"],
            row_key=row["row_key"],
            incident_id=row["incident_id"],
            digest=row["digest"],
            prev_hash=row["prev_hash"],
            incident_prev_hash=row["incident_prev_hash"],
            key_id=row["key_id"],
            hash=row["hash"],
        )


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive entries a prune removed: the hash they followed and the hash of their last, so
    that the chain still links across them (kept in `audit_prunes.runs`)."""

    first: int
    last: int
    prev_hash: str
    last_hash: str

    def as_list(self) -> list[Any]:
        return [self.first, self.last, self.prev_hash, self.last_hash]

    @classmethod
    def of(cls, values: Iterable[Any]) -> Run:
        first, last, prev_hash, last_hash = values
        return cls(int(first), int(last), str(prev_hash), str(last_hash))


def runs_of(entries: Iterable[Entry]) -> list[Run]:
    """The runs of consecutive sequence numbers among `entries`."""
    runs: list[Run] = []
    for entry in sorted(entries, key=lambda e: e.seq):
        if runs and runs[-1].last + 1 == entry.seq:
            runs[-1] = Run(runs[-1].first, entry.seq, runs[-1].prev_hash, entry.hash)
        else:
            runs.append(Run(entry.seq, entry.seq, entry.prev_hash, entry.hash))
    return runs


@dataclass(frozen=True, slots=True)
class Problem:
    """A broken link: where (the entry's seq, the row) and what does not hold."""

    seq: int | None
    table: str | None
    row_key: str | None
    incident_id: str | None
    what: str

    def describe(self) -> str:
        where = f"seq {self.seq}" if self.seq is not None else "no entry"
        row = f" {self.table} {self.row_key}" if self.table else ""
        incident = f" (incident {self.incident_id})" if self.incident_id else ""
        return f"{where}:{row}{incident}: {self.what}"

    def sort_key(self) -> tuple[int, int]:
        return (0, self.seq) if self.seq is not None else (1, 0)


@dataclass
class Walk:
    """Checks entries in sequence order: each follows the one before it (or a pruned run) in the
    global chain and its incident's, and its own hash holds.

    `trust_starts`: the first entry seen, and each incident's first, are taken as linked (a walk
    from a point in time). An archive's walk `jump`s to each run it holds instead."""

    key: ChainKey | None
    trust_starts: bool = False
    problems: list[Problem] = field(default_factory=list)
    next_seq: int | None = 1
    prev_hash: str | None = GENESIS
    incident_heads: dict[str, str] = field(default_factory=dict)
    keyed_seen: bool = False
    unchecked: int = 0  # entries keyed with a key this walk does not hold: their hashes not checked
    last: Entry | None = None

    def __post_init__(self) -> None:
        if self.trust_starts:
            self.next_seq, self.prev_hash = None, None

    def jump(self, seq: int, prev_hash: str) -> None:
        """Continue from an entry not walked: `seq` follows `prev_hash`."""
        self.next_seq, self.prev_hash = seq, prev_hash

    def run(self, run: Run) -> None:
        """A pruned run: it must sit where the chain is and follow its hash."""
        if self.next_seq is not None and run.first != self.next_seq:
            self._gap(run.first)
        if self.prev_hash is not None and run.prev_hash != self.prev_hash:
            self._problem(
                run.first, None, f"pruned entries {run.first}-{run.last} do not follow seq {run.first - 1}"
            )
        self.next_seq, self.prev_hash = run.last + 1, run.last_hash

    def entry(self, entry: Entry) -> None:
        if self.next_seq is not None and entry.seq != self.next_seq:
            self._gap(entry.seq)
        if self.prev_hash is not None and entry.prev_hash != self.prev_hash:
            self._problem(entry.seq, entry, "its previous hash is not the hash of the entry before it")
        if entry.incident_id is not None:
            head = self.incident_heads.get(entry.incident_id)
            if (head is not None or not self.trust_starts) and entry.incident_prev_hash != head:
                self._problem(
                    entry.seq, entry, "its incident's previous hash is not the incident's entry before it"
                )
            self.incident_heads[entry.incident_id] = entry.hash
        elif entry.incident_prev_hash is not None:
            self._problem(entry.seq, entry, "an incident hash on an entry of no incident")
        self._own_hash(entry)
        self.next_seq, self.prev_hash, self.last = entry.seq + 1, entry.hash, entry

    def _own_hash(self, entry: Entry) -> None:
        if entry.key_id is None:
            if self.keyed_seen:
                self._problem(entry.seq, entry, "an unkeyed entry after keyed ones")
            elif entry.computed_hash(None) != entry.hash:
                self._problem(entry.seq, entry, "its hash does not match its content")
            return
        self.keyed_seen = True
        if self.key is None:
            self.unchecked += 1
        elif entry.key_id != self.key.id:
            self._problem(
                entry.seq,
                entry,
                f"keyed with another key (id {entry.key_id}, MEDIC_AUDIT_KEY's is {self.key.id})",
            )
        elif entry.computed_hash(self.key) != entry.hash:
            self._problem(entry.seq, entry, "its hash does not match its content (keyed)")

    def _gap(self, seq: int) -> None:
        assert self.next_seq is not None
        if seq > self.next_seq:
            self._problem(self.next_seq, None, f"entries {self.next_seq}-{seq - 1} are missing")
        else:
            self._problem(seq, None, f"seq {seq} is out of order (expected {self.next_seq})")

    def _problem(self, seq: int, entry: Entry | None, what: str) -> None:
        self.problems.append(
            Problem(
                seq,
                entry.table if entry else None,
                entry.row_key if entry else None,
                entry.incident_id if entry else None,
                what,
            )
        )
