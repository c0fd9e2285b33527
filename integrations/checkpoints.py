"""`CheckpointStore` over PyTorch Distributed Checkpoints (DCP) on a shared filesystem or S3.

A job's checkpoints live in one folder (or S3 prefix) per step, `step-XXXXXXXX/`. DCP writes each
rank's shard files first and the `.metadata` file last, so a save cut short leaves a folder with
no `.metadata`, or with shards missing or shorter than the metadata says. Only a COMPLETE folder
counts: `.metadata` present and readable by DCP's own reader, and every byte range its
`storage_data` references present. The resume step is the newest complete one.

torch is imported only when a checkpoint is actually read: it is an optional dependency
(the `train` extra) and costs seconds to import.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medic.errors import PermanentError
from medic.protocols import Checkpoint

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

log = logging.getLogger(__name__)

METADATA_FILE = ".metadata"  # the name DCP's FileSystemWriter gives it
STEP_DIR = re.compile(r"^step-(\d{8,})$")


class IncompleteCheckpoint(PermanentError):
    """Raised when a step folder cannot be resumed from, saying why (the store skips to an older one)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def read_metadata(directory: Path) -> Metadata:
    """DCP's metadata of a checkpoint folder, read by DCP itself; IncompleteCheckpoint if unreadable."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (directory / METADATA_FILE).is_file():
        raise IncompleteCheckpoint(f"no {METADATA_FILE} (the save did not finish)")
    try:
        return FileSystemReader(str(directory)).read_metadata()
    except Exception as error:  # a torn pickle raises whatever the unpickler hits first
        raise IncompleteCheckpoint(f"{METADATA_FILE} is unreadable: {error!r}") from None


def required_sizes(metadata: Metadata) -> dict[str, int]:
    """Each shard file the metadata references and the size it must at least have."""
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    return sizes


def check_shards(metadata: Metadata, present: Mapping[str, int]) -> None:
    """Raise IncompleteCheckpoint unless every referenced shard is present and long enough."""
    required = required_sizes(metadata)
    if not required:
        raise IncompleteCheckpoint(f"{METADATA_FILE} references no shard files")
    for name, size in sorted(required.items()):
        if name not in present:
            raise IncompleteCheckpoint(f"shard {name} is missing")
        if present[name] < size:
            raise IncompleteCheckpoint(f"shard {name} is truncated ({present[name]} of {size} bytes)")


def check_directory(directory: Path) -> Metadata:
    """The metadata of a complete checkpoint folder; IncompleteCheckpoint says why it is not."""
    metadata = read_metadata(directory)
    present = {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}
    check_shards(metadata, present)
    return metadata


def _newest_first(names: Iterable[str]) -> list[tuple[int, str]]:
    steps = ((parse_step(name), name) for name in names)
    return sorted(((step, name) for step, name in steps if step is not None), reverse=True)


def latest_in_directory(job: str, directory: Path) -> Checkpoint | None:
    """The newest complete checkpoint under `directory` (its `step-XXXXXXXX/` folders)."""
    if not directory.is_dir():
        return None
    for step, name in _newest_first(p.name for p in directory.iterdir() if p.is_dir()):
        folder = directory / name
        try:
            check_directory(folder)
        except IncompleteCheckpoint as why:
            log.info("skipping checkpoint %s: %s", folder, why)
            continue
        saved_at = datetime.fromtimestamp((folder / METADATA_FILE).stat().st_mtime, UTC)
        return Checkpoint(job, step, saved_at, str(folder))
    return None


class DcpCheckpointStore:
    """Checkpoints on a local or shared filesystem: `root/JOB/step-XXXXXXXX/`, or a folder per job."""

    def __init__(self, root: Path | str | None = None, jobs: Mapping[str, Path | str] | None = None) -> None:
        if root is None and not jobs:
            raise ValueError("give a root folder, a folder per job, or both")
        self.root = Path(root) if root is not None else None
        self.jobs = {job: Path(path) for job, path in (jobs or {}).items()}

    def directory(self, job: str) -> Path | None:
        if job in self.jobs:
            return self.jobs[job]
        return self.root / job if self.root is not None else None

    def latest(self, job: str) -> Checkpoint | None:
        directory = self.directory(job)
        return latest_in_directory(job, directory) if directory is not None else None


class S3CheckpointStore:
    """Checkpoints in S3 under `s3://bucket/prefix/JOB/step-XXXXXXXX/`; `client` is a boto3 S3 client.

    Completeness is decided from one listing (key sizes) and the `.metadata` object, which is
    downloaded and read with DCP's own reader. The metadata is a pickle, as DCP itself reads it:
    point this only at buckets the training jobs write.
    """

    def __init__(self, client: Any, bucket: str, prefix: str = "") -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")

    def job_prefix(self, job: str) -> str:
        return f"{self.prefix}/{job}/" if self.prefix else f"{job}/"

    def _objects(self, prefix: str) -> dict[str, dict[str, Any]]:
        objects: dict[str, dict[str, Any]] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                objects[item["Key"]] = item
        return objects

    def _read_metadata(self, key: str) -> Metadata:
        with tempfile.TemporaryDirectory(prefix="medic-dcp-") as scratch:
            self.client.download_file(self.bucket, key, str(Path(scratch) / METADATA_FILE))
            return read_metadata(Path(scratch))

    def latest(self, job: str) -> Checkpoint | None:
        base = self.job_prefix(job)
        by_step: dict[str, dict[str, dict[str, Any]]] = {}
        for key, item in self._objects(base).items():
            folder, _, name = key[len(base) :].partition("/")
            if name and "/" not in name:
                by_step.setdefault(folder, {})[name] = item
        for step, folder in _newest_first(by_step):
            files = by_step[folder]
            location = f"s3://{self.bucket}/{base}{folder}"
            try:
                if METADATA_FILE not in files:
                    raise IncompleteCheckpoint(f"no {METADATA_FILE} (the save did not finish)")
                metadata = self._read_metadata(f"{base}{folder}/{METADATA_FILE}")
                check_shards(metadata, {name: item["Size"] for name, item in files.items()})
            except IncompleteCheckpoint as why:
                log.info("skipping checkpoint %s: %s", location, why)
                continue
            saved_at = files[METADATA_FILE]["LastModified"].astimezone(UTC)
            return Checkpoint(job, step, saved_at, location)
        return None


def lost_work_seconds(checkpoint: Checkpoint, fault_time: datetime) -> float:
    """Training time a restart from `checkpoint` repeats: from its save to the fault (never negative)."""
    return max(0.0, (fault_time - checkpoint.saved_at).total_seconds())
