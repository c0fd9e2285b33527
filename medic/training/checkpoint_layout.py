"""The checkpoint layout that the training job writes and GPU Medic reads: the one definition of both.

A job's checkpoints live in one folder per step, `step-XXXXXXXX/`. DCP writes each rank's shard
files first and the `.metadata` file last, so a save cut short leaves a folder with no `.metadata`,
or with shards missing or shorter than the metadata says. Only a COMPLETE folder counts: `.metadata`
present and readable by DCP's own reader, and every byte range its `storage_data` references
present. The resume step is the newest complete one.

Standard library only, with torch imported when a checkpoint is actually read: a training process
resumes without importing GPU Medic (pydantic included), and GPU Medic reads checkpoints without
paying for torch until it has to. medic/integrations/checkpoints.py loads this file from here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

log = logging.getLogger(__name__)

METADATA_FILE = ".metadata"  # the name DCP's FileSystemWriter gives it
STEP_DIR = re.compile(r"^step-(\d{8,})$")


class IncompleteCheckpoint(Exception):
    """Raised when a step folder cannot be resumed from, saying why (the search skips to an older one)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def newest_first(names: Iterable[str]) -> list[tuple[int, str]]:
    """(step, name) of the step folders among `names`, the newest first."""
    steps = ((parse_step(name), name) for name in names)
    return sorted(((step, name) for step, name in steps if step is not None), reverse=True)


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


def latest_complete(directory: Path) -> tuple[int, Path] | None:
    """The step and folder of the newest complete checkpoint under `directory`, if any."""
    if not directory.is_dir():
        return None
    for step, name in newest_first(p.name for p in directory.iterdir() if p.is_dir()):
        folder = directory / name
        try:
            check_directory(folder)
        except IncompleteCheckpoint as why:
            log.info("skipping checkpoint %s: %s", folder, why)
            continue
        return step, folder
    return None
