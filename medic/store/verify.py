"""`medic audit verify`: walk the audit chain and check every audited row against it.

The walk checks that each entry follows the one before it (or a run a prune removed) in the global
chain and in its incident's, and that its hash holds; then every row of the audited tables is
digested again and compared with its newest entry. A row edited, deleted or added behind the store's
back, an entry edited or deleted, each is a problem named by where it is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.engine import Connection
from sqlmodel import SQLModel

from medic.store.chain import AUDITED, Entry, Problem, Run, Walk, row_digest
from medic.store.engine import StoreBase
from medic.store.ledger import CHAIN
from medic.store.tables import AuditPruneRecord

PRUNES = SQLModel.metadata.tables[AuditPruneRecord.__tablename__]


@dataclass(frozen=True, slots=True)
class Verification:
    entries: int  # walked
    rows: int  # checked against their newest entry
    pruned: int  # entries prunes removed, linked across
    head: Entry | None  # the newest entry
    unchecked: int  # keyed entries whose hashes were not checked: MEDIC_AUDIT_KEY is not set
    problems: list[Problem]  # in chain order: the first is the first broken link

    @property
    def ok(self) -> bool:
        return not self.problems


class VerifyMixin(StoreBase):
    def verify_chain(self, since: datetime | None = None) -> Verification:
        """Check the whole chain, or the entries written since `since` and the rows they sealed
        (the link into the first of them is taken as given)."""
        with self.snapshot() as connection:
            start = 1
            if since is not None:
                first = connection.execute(select(func.min(CHAIN.c.seq)).where(CHAIN.c.at >= since)).scalar()
                if first is None:
                    return Verification(0, 0, 0, None, 0, [])
                start = first
            every_run = prune_runs(connection)
            runs = deque(r for r in every_run if r.first >= start)
            walk = Walk(self.audit_key, trust_starts=since is not None)
            latest: dict[tuple[str, str], Entry] = {}
            entries = 0
            for entry in _entries(connection, start):
                while runs and runs[0].first < entry.seq:
                    walk.run(runs.popleft())
                walk.entry(entry)
                latest[entry.table, entry.row_key] = entry
                entries += 1
            for run in runs:
                walk.run(run)
            rows = sum(
                _check_rows(connection, table, latest, walk.problems, whole=since is None)
                for table in AUDITED
            )
        walk.problems += [
            Problem(e.seq, e.table, e.row_key, e.incident_id, f"the row sealed at seq {e.seq} is gone")
            for e in latest.values()
            if e.digest is not None
        ]
        if self.audit_key is not None and walk.last is not None and walk.last.key_id is None:
            walk.problems.append(
                Problem(
                    walk.last.seq,
                    walk.last.table,
                    walk.last.row_key,
                    walk.last.incident_id,
                    "MEDIC_AUDIT_KEY is set but the newest entry is not keyed: without the key, the chain "
                    "up to here could have been rewritten",
                )
            )
        return Verification(
            entries=entries,
            rows=rows,
            pruned=sum(r.last - r.first + 1 for r in every_run),
            head=walk.last,
            unchecked=walk.unchecked,
            problems=sorted(walk.problems, key=Problem.sort_key),
        )


def prune_runs(connection: Connection) -> list[Run]:
    """Every run of entries a prune removed, in chain order."""
    return sorted(
        (Run.of(values) for runs in connection.execute(select(PRUNES.c.runs)).scalars() for values in runs),
        key=lambda r: r.first,
    )


def _entries(connection: Connection, start: int) -> Iterator[Entry]:
    query = select(CHAIN).where(CHAIN.c.seq >= start).order_by(CHAIN.c.seq)
    for row in connection.execution_options(yield_per=2000).execute(query).mappings():
        yield Entry.of(row)


def _check_rows(
    connection: Connection,
    table: str,
    latest: dict[tuple[str, str], Entry],
    problems: list[Problem],
    *,
    whole: bool,
) -> int:
    """Compare each row of `table` with its newest entry, taking the entry out of `latest`: the
    entries left afterwards name rows that are gone. Returns the rows checked. Not `whole`: rows the
    walk saw no entry for are not looked at."""
    spec = AUDITED[table]
    source = SQLModel.metadata.tables[table]
    checked = 0
    for row in connection.execution_options(yield_per=2000).execute(select(source)).mappings():
        key = str(row["id"])
        incident = row[spec.incident] if spec.incident else None
        entry = latest.pop((table, key), None)
        if entry is None:
            if whole:
                problems.append(
                    Problem(
                        None, table, key, incident, "the row is in no ledger entry: written behind the store"
                    )
                )
            continue
        checked += 1
        if entry.digest is None:
            problems.append(
                Problem(
                    entry.seq, table, key, incident, "the row is there, but its entry says it was deleted"
                )
            )
        elif row_digest(spec, row) != entry.digest:
            problems.append(
                Problem(
                    entry.seq,
                    table,
                    key,
                    incident,
                    f"the row's content differs from what seq {entry.seq} sealed",
                )
            )
    return checked
