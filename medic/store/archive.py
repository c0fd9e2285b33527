"""The archive a prune writes before it removes anything: gzip'd JSON lines, signed.

    {"header": {...}}                      format, when, `before`, the incidents, the chain's head
    {"row": "decisions", "values": {...}}  every row removed, as the store held it
    {"entry": {...}}                       every ledger entry removed
    {"run": [first, last, prev, last]}     the runs of the chain they made up (medic.store.chain.Run)
    {"signature": {...}}                   over every line before it: sha256, and HMAC-SHA256 under
                                           MEDIC_AUDIT_KEY when it is set

`verify_archive` checks an archive on its own: the signature, each row against its entries, and the
entries as chains (each run links from its first entry to its last, each incident's entries from its
first). The store keeps the archive's sha256 and runs in `audit_prunes`, so an archive can be told
from a forgery there too, also without the key.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from medic.store.chain import AUDITED, ChainKey, Entry, Problem, Run, Walk, jsonable, row_digest

FORMAT = "medic-audit-archive/1"


@dataclass(frozen=True, slots=True)
class ArchivedRow:
    table: str
    values: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Archive:
    header: dict[str, Any]
    rows: list[ArchivedRow]
    entries: list[Entry]
    runs: list[Run]
    signature: dict[str, Any]
    content: bytes  # every line before the signature, as read: what it signs

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


@dataclass(frozen=True, slots=True)
class ArchiveCheck:
    problems: list[Problem]
    keyed: bool  # the signature and the entries' hashes were checked with the key

    @property
    def ok(self) -> bool:
        return not self.problems


def write_archive(
    path: Path,
    header: dict[str, Any],
    rows: Iterable[ArchivedRow],
    entries: Iterable[Entry],
    runs: Iterable[Run],
    key: ChainKey | None,
) -> str:
    """Write the archive to `path`, which must not exist, through to the disk; returns its sha256."""
    lines: list[dict[str, Any]] = [{"header": {"format": FORMAT, **header}}]
    lines += [{"row": r.table, "values": r.values} for r in rows]
    lines += [{"entry": jsonable(e.values())} for e in entries]
    lines += [{"run": r.as_list()} for r in runs]
    content = b"".join(_line(line) for line in lines)
    sha256 = hashlib.sha256(content).hexdigest()
    signature = {
        "sha256": sha256,
        "key_id": key.id if key else None,
        "hmac_sha256": key.sign(content) if key else None,
    }
    with open(path, "xb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
            out.write(content + _line({"signature": signature}))
        raw.flush()
        os.fsync(raw.fileno())
    return sha256


def read_archive(path: Path) -> Archive:
    """Read an archive; ValueError if it is not one."""
    lines = gzip.decompress(path.read_bytes()).splitlines(keepends=True)
    if len(lines) < 2:
        raise ValueError(f"{path}: not a GPU Medic audit archive")
    parsed = [json.loads(line) for line in lines]
    header, signature = parsed[0].get("header"), parsed[-1].get("signature")
    if not isinstance(header, dict) or header.get("format") != FORMAT or not isinstance(signature, dict):
        raise ValueError(f"{path}: not a GPU Medic audit archive ({FORMAT})")
    body = parsed[1:-1]
    return Archive(
        header=header,
        rows=[ArchivedRow(line["row"], line["values"]) for line in body if "row" in line],
        entries=[Entry.of(line["entry"]) for line in body if "entry" in line],
        runs=[Run.of(line["run"]) for line in body if "run" in line],
        signature=signature,
        content=b"".join(lines[:-1]),
    )


def verify_archive(archive: Archive, key: ChainKey | None) -> ArchiveCheck:
    """Check the signature first (a problem there comes first), then the entries and rows."""
    problems: list[Problem] = []
    walk = Walk(key)
    entries = iter(sorted(archive.entries, key=lambda e: e.seq))
    pending = next(entries, None)
    walked = 0
    for run in sorted(archive.runs, key=lambda r: r.first):
        walk.jump(run.first, run.prev_hash)
        while pending is not None and pending.seq <= run.last:
            if pending.seq >= run.first:
                walk.entry(pending)
                walked += 1
            pending = next(entries, None)
        if walk.next_seq != run.last + 1 or walk.prev_hash != run.last_hash:
            problems.append(
                Problem(
                    run.last, None, None, None, f"the run {run.first}-{run.last} does not end as recorded"
                )
            )
    if walked != len(archive.entries):
        problems.append(
            Problem(None, None, None, None, f"{len(archive.entries) - walked} entries are in no run")
        )
    problems += walk.problems + _row_problems(archive)
    keyed = key is not None and archive.signature.get("key_id") == key.id
    return ArchiveCheck(
        _signature_problems(archive, key) + sorted(problems, key=Problem.sort_key), keyed=keyed
    )


def _signature_problems(archive: Archive, key: ChainKey | None) -> list[Problem]:
    if archive.signature.get("sha256") != archive.sha256:
        return [Problem(None, None, None, None, "the content does not match its sha256: changed or damaged")]
    signed_with = archive.signature.get("key_id")
    if key is None or signed_with is None:
        return []
    if signed_with != key.id:
        return [
            Problem(
                None,
                None,
                None,
                None,
                f"signed with another key (id {signed_with}, MEDIC_AUDIT_KEY's is {key.id})",
            )
        ]
    if key.sign(archive.content) != archive.signature.get("hmac_sha256"):
        return [
            Problem(None, None, None, None, "the HMAC signature does not match: not written with this key")
        ]
    return []


def _row_problems(archive: Archive) -> list[Problem]:
    latest = {(e.table, e.row_key): e for e in sorted(archive.entries, key=lambda e: e.seq)}
    problems = []
    for row in archive.rows:
        spec = AUDITED.get(row.table)
        if spec is None:  # kept with its incident, never sealed (goodput): the signature covers it
            continue
        key = str(row.values["id"])
        entry = latest.pop((row.table, key), None)
        if entry is None:
            problems.append(Problem(None, row.table, key, None, "an archived row with no archived entry"))
        elif entry.digest != row_digest(spec, row.values):
            problems.append(
                Problem(
                    entry.seq,
                    row.table,
                    key,
                    entry.incident_id,
                    f"the row's content differs from what seq {entry.seq} sealed",
                )
            )
    problems += [
        Problem(e.seq, e.table, e.row_key, e.incident_id, "an archived entry whose row is not archived")
        for e in latest.values()
        if e.digest is not None
    ]
    return problems


def _line(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
