"""`CheckpointStore` over PyTorch Distributed Checkpoints (DCP) on a shared filesystem or S3.

What a complete checkpoint is, and how its folders are named, is defined once, in
medic.training.checkpoint_layout (medic/training/), beside the job that writes them: the training
process imports it without the rest of GPU Medic, and so does this module.

torch is imported only when a checkpoint is actually read: it is an optional dependency
(the `train` extra) and costs seconds to import.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medic.errors import PermanentError
from medic.protocols import Checkpoint
from medic.training import checkpoint_layout as layout

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

log = logging.getLogger(__name__)

METADATA_FILE: str = layout.METADATA_FILE
step_dir_name = layout.step_dir_name
parse_step = layout.parse_step


class IncompleteCheckpoint(layout.IncompleteCheckpoint, PermanentError):
    """Raised when a step folder cannot be resumed from, saying why (the store skips to an older one).

    The layout's own error, made permanent for GPU Medic's retry rules: a retry completes no checkpoint.
    """


def check_directory(directory: Path) -> Metadata:
    """The metadata of a complete checkpoint folder; IncompleteCheckpoint says why it is not."""
    try:
        return layout.check_directory(directory)
    except layout.IncompleteCheckpoint as why:
        raise IncompleteCheckpoint(str(why)) from None


def latest_in_directory(job: str, directory: Path) -> Checkpoint | None:
    """The newest complete checkpoint under `directory` (its `step-XXXXXXXX/` folders)."""
    found = layout.latest_complete(directory)
    if found is None:
        return None
    step, folder = found
    saved_at = datetime.fromtimestamp((folder / METADATA_FILE).stat().st_mtime, UTC)
    return Checkpoint(job, step, saved_at, str(folder))


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
            return layout.read_metadata(Path(scratch))

    def latest(self, job: str) -> Checkpoint | None:
        base = self.job_prefix(job)
        by_step: dict[str, dict[str, dict[str, Any]]] = {}
        for key, item in self._objects(base).items():
            folder, _, name = key[len(base) :].partition("/")
            if name and "/" not in name:
                by_step.setdefault(folder, {})[name] = item
        for step, folder in layout.newest_first(by_step):
            files = by_step[folder]
            location = f"s3://{self.bucket}/{base}{folder}"
            try:
                if METADATA_FILE not in files:
                    raise layout.IncompleteCheckpoint(f"no {METADATA_FILE} (the save did not finish)")
                metadata = self._read_metadata(f"{base}{folder}/{METADATA_FILE}")
                layout.check_shards(metadata, {name: item["Size"] for name, item in files.items()})
            except layout.IncompleteCheckpoint as why:
                log.info("skipping checkpoint %s: %s", location, why)
                continue
            saved_at = files[METADATA_FILE]["LastModified"].astimezone(UTC)
            return Checkpoint(job, step, saved_at, location)
        return None


def lost_work_seconds(checkpoint: Checkpoint, fault_time: datetime) -> float:
    """Training time a restart from `checkpoint` repeats: from its save to the fault (never negative)."""
    return max(0.0, (fault_time - checkpoint.saved_at).total_seconds())
