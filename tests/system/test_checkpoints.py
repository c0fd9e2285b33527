"""Finding the newest COMPLETE DCP checkpoint, on a filesystem and in S3 (a real moto server).

The checkpoints come from one real torchrun launch (~5 s): rank 1 dies inside the step-20 save
after writing its shard, so step 10 is complete and step 20 is a genuinely interrupted save.
The other kinds of damage are applied to copies of the complete step.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from torchrun_support import Run, free_port, torchrun

from medic.integrations.checkpoints import (
    METADATA_FILE,
    DcpCheckpointStore,
    IncompleteCheckpoint,
    S3CheckpointStore,
    check_directory,
    lost_work_seconds,
    step_dir_name,
)
from medic.protocols import Checkpoint, CheckpointStore

JOB = "reference-train"
BUCKET = "checkpoints"

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    faults = ("--fail-at-step=20", "--fail-during-save", "--fail-rank=1")
    run = torchrun(tmp_path_factory.mktemp("interrupted"), 2, "--steps=20", "--ckpt-every=10", *faults)
    assert run.returncode != 0, run.output
    return run


@pytest.fixture(scope="module")
def s3_client() -> Iterator[Any]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except Exception:  # the server is still starting: connection refused
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise
            time.sleep(0.1)
    yield client
    server.terminate()
    server.wait(timeout=10)


def _remove_metadata(folder: Path) -> None:
    (folder / METADATA_FILE).unlink()


def _tear_metadata(folder: Path) -> None:
    path = folder / METADATA_FILE
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _remove_shard(folder: Path) -> None:
    (folder / "__1_0.distcp").unlink()


def _truncate_shard(folder: Path) -> None:
    path = folder / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:-1])


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "no metadata": (_remove_metadata, "no .metadata"),
    "torn metadata": (_tear_metadata, "unreadable"),
    "missing shard": (_remove_shard, "shard __1_0.distcp is missing"),
    "truncated shard": (_truncate_shard, "shard __0_0.distcp is truncated"),
}


def job_folder(run: Run, root: Path, damage: Callable[[Path], None] | None) -> Path:
    """root/JOB with the real complete step 10 and a copy of it as step 30, damaged or not."""
    folder = root / JOB
    complete = run.ckpt_dir / step_dir_name(10)
    shutil.copytree(complete, folder / step_dir_name(10))
    shutil.copytree(complete, folder / step_dir_name(30))
    if damage:
        damage(folder / step_dir_name(30))
    return folder


def upload(client: Any, folder: Path, base: str) -> None:
    """Every file under `folder` to `base/` + its relative path."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{base}/{path.relative_to(folder).as_posix()}")


def test_an_interrupted_save_is_skipped(interrupted: Run) -> None:
    cut_short = interrupted.ckpt_dir / step_dir_name(20)
    assert sorted(p.name for p in cut_short.iterdir()) == ["__0_0.distcp", "__1_0.distcp"]  # no .metadata
    with pytest.raises(IncompleteCheckpoint, match=r"no \.metadata"):
        check_directory(cut_short)

    store = DcpCheckpointStore(jobs={JOB: interrupted.ckpt_dir})
    assert isinstance(store, CheckpointStore)
    latest = store.latest(JOB)
    folder = interrupted.ckpt_dir / step_dir_name(10)
    mtime = datetime.fromtimestamp((folder / METADATA_FILE).stat().st_mtime, UTC)
    assert latest == Checkpoint(JOB, 10, mtime, str(folder))


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newer_checkpoint_is_skipped_on_a_filesystem(
    interrupted: Run, tmp_path: Path, damage: str
) -> None:
    breaks, reason = DAMAGE[damage]
    folder = job_folder(interrupted, tmp_path, breaks)
    with pytest.raises(IncompleteCheckpoint, match=re.escape(reason)):
        check_directory(folder / step_dir_name(30))
    assert DcpCheckpointStore(root=tmp_path).latest(JOB).step == 10  # type: ignore[union-attr]


def test_the_newest_complete_checkpoint_wins(interrupted: Run, tmp_path: Path) -> None:
    folder = job_folder(interrupted, tmp_path, damage=None)
    (folder / "step-00000040.tmp").mkdir()  # not a step folder: ignored
    (folder / "notes").mkdir()
    store = DcpCheckpointStore(root=tmp_path)
    assert store.latest(JOB) == Checkpoint(
        JOB,
        30,
        datetime.fromtimestamp((folder / step_dir_name(30) / METADATA_FILE).stat().st_mtime, UTC),
        str(folder / step_dir_name(30)),
    )
    assert store.latest("another-job") is None
    with pytest.raises(ValueError, match="root folder"):
        DcpCheckpointStore()


@pytest.mark.parametrize("damage", [None, *DAMAGE])
def test_s3_finds_the_newest_complete_checkpoint(
    interrupted: Run, tmp_path: Path, s3_client: Any, damage: str | None
) -> None:
    prefix = f"runs/{damage or 'intact'}".replace(" ", "-")
    folder = job_folder(interrupted, tmp_path, DAMAGE[damage][0] if damage else None)
    upload(s3_client, folder, f"{prefix}/{JOB}")
    before = datetime.now(UTC)
    latest = S3CheckpointStore(s3_client, BUCKET, prefix=prefix).latest(JOB)
    step = 10 if damage else 30
    assert latest is not None
    assert (latest.job, latest.step) == (JOB, step)
    assert latest.location == f"s3://{BUCKET}/{prefix}/{JOB}/{step_dir_name(step)}"
    key = f"{prefix}/{JOB}/{step_dir_name(step)}/{METADATA_FILE}"
    assert latest.saved_at == s3_client.head_object(Bucket=BUCKET, Key=key)["LastModified"]
    assert before - timedelta(minutes=1) < latest.saved_at <= before


def test_s3_with_the_real_interrupted_save(interrupted: Run, s3_client: Any) -> None:
    upload(s3_client, interrupted.ckpt_dir, f"real/{JOB}")
    store = S3CheckpointStore(s3_client, BUCKET, prefix="real/")
    latest = store.latest(JOB)
    assert latest is not None and latest.step == 10
    assert store.latest("no-such-job") is None


def test_lost_work_is_the_time_since_the_save() -> None:
    saved = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
    checkpoint = Checkpoint(JOB, 10, saved, "/ckpt/step-00000010")
    assert lost_work_seconds(checkpoint, saved + timedelta(minutes=4, seconds=30)) == 270.0
    assert lost_work_seconds(checkpoint, saved - timedelta(seconds=5)) == 0.0  # clocks disagree a little
