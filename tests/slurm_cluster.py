"""A real Slurm cluster on this machine for the tests that need one (tests/system/test_slurm.py and
the others that import these fixtures).

scripts/slurm-cluster.sh starts a private munged, slurmctld and four slurmd (gpu-node-1..4, 8 fake GPUs
each) on free ports under a temporary directory; `cluster` lives for a test module, `slurm` puts it back
to four idle nodes after each test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from checkout import REPO_ROOT
from replicas_support import free_port_block

from medic.integrations.slurm import SlurmCli
from medic.integrations.slurm.records import SlurmJob
from medic.protocols import JobState

SCRIPTS = REPO_ROOT / "scripts"
NODES = [f"gpu-node-{i}" for i in range(1, 5)]
T = TypeVar("T")


def until(check: Callable[[], T | None], what: str, timeout_s: float = 30.0) -> T:
    deadline = time.monotonic() + timeout_s
    while (result := check()) is None or result is False:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)
    return result


@dataclass
class Cluster:
    base: Path
    cli: SlurmCli
    started_in_s: float

    def run(self, *args: str, user: str | None = None) -> str:
        command = ["runuser", "-u", user, "--", *args] if user else list(args)
        done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=30)
        return done.stdout.strip()

    def sbatch(self, *options: str, user: str | None = None) -> str:
        return self.run(
            "sbatch",
            "--parsable",
            "--chdir=/tmp",
            "--output=/dev/null",
            *options,
            "--wrap",
            "sleep 300",
            user=user,
        )

    def running(self, job_id: str) -> SlurmJob:
        def check() -> SlurmJob | None:
            job = next((j for j in self.cli.jobs() if j.id == job_id), None)
            return job if job and job.state == "RUNNING" else None

        return until(check, f"job {job_id} to run")

    def settle(self) -> None:
        """Back to four idle nodes and no jobs, whatever a test left behind."""
        ids = [j.id for j in self.cli.jobs() if j.job_state in (JobState.PENDING, JobState.RUNNING)]
        if ids:
            self.run("scancel", *ids)
        for node in self.cli.nodes():
            if node.flags & {"DRAIN", "FAIL"} or node.base == "down":
                self.run("scontrol", "update", f"nodename={node.name}", "state=resume")
        until(
            lambda: (
                all(n.base == "idle" and not n.flags for n in self.cli.nodes())
                and not any(j.job_state is JobState.RUNNING for j in self.cli.jobs())
            ),
            "four idle nodes and no running jobs",
        )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if shutil.which("slurmctld") is None:
        subprocess.run([str(SCRIPTS / "install-slurm.sh")], check=True, timeout=600)
    # Not under pytest's tmp_path: munged wants every directory above its socket searchable by all.
    base = Path(tempfile.mkdtemp(prefix="medic-slurm-"))
    base.chmod(0o755)
    ports = free_port_block(len(NODES) + 1)
    env = {
        **os.environ,
        "SLURM_TEST_BASE": str(base),
        "SLURM_TEST_NODES": str(len(NODES)),
        "SLURM_TEST_CTLD_PORT": str(ports),
        "SLURM_TEST_NODE_PORT0": str(ports),  # node i listens on ports + i
    }
    script = str(SCRIPTS / "slurm-cluster.sh")
    started = time.monotonic()
    subprocess.run([script, "start"], env=env, check=True, timeout=120)
    cluster = Cluster(base, SlurmCli(), time.monotonic() - started)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SLURM_CONF", str(base / "etc" / "slurm.conf"))
            yield cluster
    finally:
        subprocess.run([script, "stop"], env=env, check=True, timeout=120)
        shutil.rmtree(base)


@pytest.fixture
def slurm(cluster: Cluster) -> Iterator[Cluster]:
    yield cluster
    cluster.settle()
