"""`medic triage` with its reading in a forked process (medic/apps/cli/triage_parallel.py) prints what it
prints reading the file itself: the same incidents, the same rejections in the same order, the same
duplicates, the same fallback for a file out of time order."""

from __future__ import annotations

import gc
import os
import random
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from bench.triage import generate
from forks_support import assert_helper_ends_with_its_parent
from typer.testing import CliRunner

import medic.apps.cli.triage_parallel as parallel
from medic.apps.cli.app import app
from medic.apps.cli.triage import NEVER, young_collections_only

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("cli_env")


@pytest.fixture(scope="module")
def feed(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """3,000 generated events (every kind, jobs' timeouts for the differential) with bad lines among them."""
    path = tmp_path_factory.mktemp("feed") / "feed.jsonl"
    generate(path, count=3_000, nodes=40, seed=5)
    lines = path.read_text(encoding="utf-8").splitlines()
    rng = random.Random(5)
    for bad in (
        "junk",
        '{"id": "x"}',
        "",
        lines[10],
        '{"id": "nan", "kind": "xid", "gpu": NaN}',
        lines[2_000],
    ):
        lines.insert(rng.randrange(len(lines)), bad)
    return lines


def _triage(path: Path, *options: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["triage", str(path), *options])
    return result.exit_code, result.stdout, result.stderr


def _forked_and_alone(
    monkeypatch: pytest.MonkeyPatch, path: Path, *options: str
) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """The command's exit code and output with the reading forked (a few events at a time, so the
    hand-over's edges and its read-ahead both come up), then with this process reading alone."""
    forked = []
    events = parallel.ForkedReader.events

    def counted(self: parallel.ForkedReader, on_rejected: object) -> object:
        forked.append(self.path)
        return events(self, on_rejected)  # type: ignore[arg-type]

    monkeypatch.setattr(parallel.ForkedReader, "events", counted)
    monkeypatch.setattr(parallel, "PARALLEL_FROM", 0)
    monkeypatch.setattr(parallel, "HANDFUL", 7)
    monkeypatch.setattr(parallel, "AHEAD", 2)
    with_fork = _triage(path, *options)
    assert forked == [path]
    monkeypatch.setattr(parallel, "PARALLEL_FROM", path.stat().st_size + 1)
    alone = _triage(path, *options)
    assert forked == [path]
    return with_fork, alone


@pytest.mark.parametrize("options", [("--json",), ()], ids=["json", "table"])
def test_a_forked_reading_prints_what_reading_alone_prints(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, feed: list[str], options: tuple[str, ...]
) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(feed) + "\n", encoding="utf-8")
    with_fork, alone = _forked_and_alone(monkeypatch, path, *options)
    assert with_fork == alone
    code, stdout, stderr = alone
    assert code == 0
    assert len(stdout.splitlines()) > 300
    assert stderr.count("rejected") == 3 and "ignored 2 repeated event ids" in stderr


def test_a_file_out_of_order_falls_back_the_same_with_a_forked_reading(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, feed: list[str]
) -> None:
    shuffled = feed[:]
    random.Random(11).shuffle(shuffled)
    path = tmp_path / "shuffled.jsonl"
    path.write_text("\n".join(shuffled) + "\n", encoding="utf-8")
    with_fork, alone = _forked_and_alone(monkeypatch, path, "--json")
    assert with_fork == alone
    code, stdout, stderr = alone
    assert code == 0 and stdout
    assert stderr.count("rejected") == 3  # each once, though the file is read twice


def test_a_reading_process_that_dies_fails_the_command_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, feed: list[str]
) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(feed) + "\n", encoding="utf-8")

    def dies(_: Path, receive: Connection, send: Connection) -> None:
        os._exit(3)  # before handing anything over: nothing may be triaged as if the file ended here

    monkeypatch.setattr(parallel, "PARALLEL_FROM", 0)
    monkeypatch.setattr(parallel, "_read", dies)
    code, stdout, stderr = _triage(path, "--json")
    assert code == 2
    assert stdout == ""
    assert f"the process reading {path} ended (exit code 3) before the end of the file" in stderr


def test_a_stream_runs_without_full_collections_and_puts_them_back() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), young_collections_only():
        assert gc.get_threshold() == (*before[:2], NEVER)
        raise RuntimeError("a stream that fails")
    assert gc.get_threshold() == before


STUCK = """
import sys, time
import medic.apps.cli.triage as triage
import medic.apps.cli.triage_parallel as parallel
parallel.PARALLEL_FROM, parallel.HANDFUL, parallel.AHEAD = 0, 50, 1

def stuck(events, *_):
    next(iter(events))
    print("ready", flush=True)
    time.sleep(300)
    yield from ()

triage.stream = stuck
from medic.apps.cli.app import main
sys.argv = ["medic", "triage", sys.argv[1], "--json"]
main()
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_the_reading_process_ends_when_the_deciding_one_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    generate(path, count=20_000, nodes=40, seed=5)
    script = tmp_path / "stuck.py"
    script.write_text(STUCK, encoding="utf-8")
    assert_helper_ends_with_its_parent(script, str(path))
