"""`medic report`: the post-mortem figures, read in a few queries from a store holding incidents
written through the store's API as the flow writes them (SQLite and PostgreSQL), and its JSON,
CSV and HTML outputs (SQLite)."""

from __future__ import annotations

import base64
import csv
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from factories import fault_event, incident
from sqlalchemy import event as sa_event
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.goodput import incident_costs
from medic.report import build_report, distribution
from medic.store import Store
from medic.store.tables import GoodputRecord

NOW = datetime.now(UTC).replace(microsecond=0)
T = NOW - timedelta(hours=6)
runner = CliRunner()


@dataclass(frozen=True)
class Filled:
    store: Store
    ids: dict[str, str]  # name in this file -> incident id


def _handle(
    store: Store,
    name: str,
    events: list[Any],
    *,
    status: str,
    classification: str | None = None,
    action: str | None = None,
    rule: str | None = None,
    closed_after: timedelta | None = None,
    actions: tuple[str, ...] = (),
    lost_s: float | None = None,
) -> str:
    """One incident as its flow run leaves it: events, node actions (intent, then outcome), the job's
    resume, its status and, when it closed, what it cost each job (as medic/tasks/close.py records it)."""
    inc = incident(*events, id=f"inc-{name}")
    store.record_events([inc])
    store.open_incident(inc, owner="alice")
    for act in actions:
        key = f"{inc.id}:{inc.node}:{act}"
        store.claim_action(key, inc.id, inc.node, act)
        store.finish_action(key, "succeeded", f"{act} done")
    if lost_s is not None:
        job = events[0].job
        store.add_step(
            inc.id, "resume job", NOW, "ok", f"{job} resumed", {"job": job, "lost_seconds": lost_s}
        )
    closed = inc.opened_at + closed_after if closed_after is not None else None
    store.update_incident(
        inc.id, status=status, classification=classification, action=action, rule=rule, closed_at=closed
    )
    if closed is not None:
        detail = store.incident_detail(inc.id)
        assert detail is not None
        store.record_goodput(
            GoodputRecord(incident_id=c.incident, **{k: v for k, v in asdict(c).items() if k != "incident"})
            for c in incident_costs(detail)
        )
    return inc.id


def fill(store: Store) -> Filled:
    ids = {
        # An XID 79 storm on GPU 3: rebooted, the job resumed; closed 30 minutes after its first event.
        "bus": _handle(
            store,
            "bus",
            [
                fault_event(id="bus-1", node="gpu-001", gpu=3, job="j-1", at=T),
                fault_event(id="bus-2", node="gpu-001", gpu=3, job="j-1", at=T, minutes=1),
            ],
            status="closed",
            classification="hardware",
            action="reboot",
            rule="xid-fallen-off-bus",
            closed_after=timedelta(minutes=30),
            actions=("drain", "reboot"),
            lost_s=420.0,
        ),
        # DCGM errors on two GPUs of one node: replaced after carol approved; 45 minutes.
        "mem": _handle(
            store,
            "mem",
            [
                fault_event("dcgm_health", id="mem-1", node="gpu-002", gpu=1, job="j-1", at=T, minutes=60),
                fault_event("dcgm_health", id="mem-2", node="gpu-002", gpu=5, job="j-1", at=T, minutes=62),
            ],
            status="closed",
            classification="hardware",
            action="replace",
            rule="diag-isolate",
            closed_after=timedelta(minutes=45),
            actions=("drain", "replace"),
            lost_s=600.0,
        ),
        # A NCCL timeout on the first node again: handed to people (no MTTR of ours), node untouched.
        "net": _handle(
            store,
            "net",
            [fault_event("nccl_timeout", id="net-1", node="gpu-001", job="j-2", at=T, minutes=120)],
            status="escalated",
            classification="infrastructure",
            action="escalate",
            rule="network-switch-storm",
            closed_after=timedelta(minutes=5),
        ),
        # A NaN loss: the node left alone after dave denied a reset; 10 minutes.
        "nan": _handle(
            store,
            "nan",
            [fault_event("nan_loss", id="nan-1", node="gpu-003", job="j-2", rank=0, at=T, minutes=180)],
            status="closed",
            classification="software",
            action="none",
            rule="application-fault",
            closed_after=timedelta(minutes=10),
        ),
        # Still waiting for an answer, not decided yet.
        "wait": _handle(
            store,
            "wait",
            [fault_event("ecc", id="wait-1", node="gpu-004", gpu=0, at=T, minutes=240)],
            status="waiting for approval",
        ),
        # Ten days old: outside a 7-day report.
        "old": _handle(
            store,
            "old",
            [fault_event(id="old-1", node="gpu-001", gpu=3, at=NOW - timedelta(days=10))],
            status="closed",
            classification="hardware",
            action="reboot",
            rule="xid-fallen-off-bus",
            closed_after=timedelta(minutes=20),
            actions=("reboot",),
        ),
    }
    carol = store.request_approval(ids["mem"], "replace")
    store.answer_approval(carol.id or 0, approved=True, by="carol", via="slack")
    dave = store.request_approval(ids["nan"], "reset_gpu")
    store.answer_approval(dave.id or 0, approved=False, by="dave", via="prefect", comment="not the GPU")
    store.request_approval(ids["wait"], "replace")
    unanswered = store.request_approval(ids["net"], "drain")
    store.answer_approval(unanswered.id or 0, approved=None, by=None, via="timeout")
    return Filled(store, ids)


@pytest.fixture
def filled(store: Store) -> Filled:
    return fill(store)


def test_counts_durations_nodes_goodput_and_approvals(filled: Filled) -> None:
    store, ids = filled.store, filled.ids
    report = build_report(store.report_rows(NOW - timedelta(days=7)), since=NOW - timedelta(days=7), now=NOW)

    assert [i.id for i in report.incidents] == [ids[n] for n in ("bus", "mem", "net", "nan", "wait")]
    assert {c.value: c.incidents for c in report.by_rule} == {
        "xid-fallen-off-bus": 1,
        "diag-isolate": 1,
        "network-switch-storm": 1,
        "application-fault": 1,
        None: 1,
    }
    assert (report.by_classification[0].value, report.by_classification[0].incidents) == ("hardware", 2)
    assert {c.value: c.incidents for c in report.by_status} == {
        "closed": 3,
        "escalated": 1,
        "waiting for approval": 1,
    }

    # MTTR: opened (first event) -> closed, closed incidents only: 10, 30 and 45 minutes.
    assert report.mttr.incidents == 3
    assert (report.mttr.p50_s, report.mttr.p90_s, report.mttr.max_s) == (1800, 2700, 2700)
    assert {(b.from_s, b.incidents) for b in report.mttr.histogram if b.incidents} == {(600, 1), (1800, 2)}

    # Time to first action: first event -> the earliest action outcome, read back per incident.
    expected = {}
    for name in ("bus", "mem"):
        detail = store.incident_detail(ids[name])
        assert detail is not None
        done = min(a.finished_at for a in detail.actions if a.finished_at is not None)
        expected[ids[name]] = (done - min(e.time for e in detail.events)).total_seconds()
    got = {i.id: i.first_action_s for i in report.incidents if i.first_action_s is not None}
    assert got == pytest.approx(expected, rel=0, abs=1e-6)  # the outcome, not the intent a moment before
    assert report.time_to_first_action.max_s == pytest.approx(max(expected.values()))

    # gpu-001 had two incidents in the window (the old third is outside it).
    assert (report.nodes[0].node, report.nodes[0].incidents) == ("gpu-001", 2)
    assert {(g.node, g.gpu): g.incidents for g in report.gpus} == {
        ("gpu-001", 3): 1,
        ("gpu-002", 1): 1,
        ("gpu-002", 5): 1,
        ("gpu-004", 0): 1,
    }

    # Goodput lost: medic goodput's figures for the window's incidents, per job.
    losses = {j.job: j for j in report.goodput_lost}
    assert set(losses) == {"j-1", "j-2"}
    assert (losses["j-1"].failures, losses["j-1"].lost_work_s) == (2, 1020.0)
    recorded = store.goodput("j-1")
    assert losses["j-1"].downtime_s == pytest.approx(
        sum(g.detection_s + (g.recovery_s or 0) for g in recorded)
    )

    answers = {(a.incident, a.answer, a.by, a.via) for a in report.approvals}
    assert answers == {
        (ids["mem"], "approved", "carol", "slack"),
        (ids["nan"], "denied", "dave", "prefect"),
        (ids["wait"], "pending", None, None),
        (ids["net"], "timed out", None, "timeout"),
    }
    assert [(a.by, a.approved, a.denied) for a in report.approvers] == [("carol", 1, 0), ("dave", 0, 1)]

    everything = build_report(store.report_rows(None), since=None, now=NOW)
    assert ids["old"] in {i.id for i in everything.incidents}
    assert (everything.gpus[0].node, everything.gpus[0].gpu, everything.gpus[0].incidents) == (
        "gpu-001",
        3,
        2,
    )


def test_the_report_reads_in_six_queries_however_many_incidents(filled: Filled) -> None:
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(args[2])

    sa_event.listen(filled.store.engine, "before_cursor_execute", count)
    try:
        filled.store.report_rows(None)
    finally:
        sa_event.remove(filled.store.engine, "before_cursor_execute", count)
    assert len([s for s in statements if s.lstrip().upper().startswith("SELECT")]) == 6


def test_percentiles_are_nearest_ranks() -> None:
    d = distribution([*map(float, range(100, 0, -1)), None])
    assert (d.incidents, d.p50_s, d.p90_s, d.p99_s, d.max_s) == (100, 50, 90, 99, 100)
    assert sum(b.incidents for b in d.histogram) == 100
    empty = distribution([])
    assert (empty.incidents, empty.p50_s, empty.max_s) == (0, None, None)


# --- the command ------------------------------------------------------------------------------

# The JSON's keys, pinned: docs/report.md documents them for the SREs' own tools.
SCHEMA = {
    "": {
        "schema_version",
        "generated_at",
        "since",
        "incidents",
        "by_status",
        "by_classification",
        "by_action",
        "by_rule",
        "mttr",
        "time_to_first_action",
        "nodes",
        "gpus",
        "goodput_lost",
        "approvals",
        "approvers",
        "held",
    },
    "incidents": {
        "id",
        "node",
        "scope",
        "opened_at",
        "closed_at",
        "status",
        "classification",
        "action",
        "rule",
        "jobs",
        "repair_s",
        "first_action_s",
    },
    "by_rule": {"value", "incidents"},
    "mttr": {"incidents", "p50_s", "p90_s", "p99_s", "max_s", "histogram"},
    "histogram": {"from_s", "to_s", "incidents"},
    "nodes": {"node", "incidents"},
    "gpus": {"node", "gpu", "incidents"},
    "goodput_lost": {"job", "failures", "detection_s", "recovery_s", "lost_work_s", "downtime_s"},
    "approvals": {
        "incident",
        "node",
        "action",
        "requested_at",
        "answered_at",
        "answer",
        "by",
        "via",
        "wait_s",
    },
    "approvers": {"by", "approved", "denied"},
    "held": {"node", "incident", "action", "since", "incident_status", "outcome"},
}


@pytest.fixture
def cli_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Filled]:
    url = f"sqlite:///{tmp_path / 'medic.db'}"
    monkeypatch.setenv("MEDIC_DATABASE_URL", url)
    monkeypatch.setenv("COLUMNS", "200")
    store = Store(url)
    yield fill(store)
    store.close()


def invoke(*args: str) -> Any:
    result = runner.invoke(app, ["report", *args])
    assert result.exit_code == 0, result.output
    return result


def test_json_keeps_its_documented_keys(cli_store: Filled) -> None:
    data = json.loads(invoke("--since", "7d", "--json").stdout)
    assert set(data) == SCHEMA[""]
    assert data["schema_version"] == 1
    for key in ("incidents", "by_rule", "nodes", "gpus", "goodput_lost", "approvals", "approvers", "held"):
        assert data[key] and all(set(item) == SCHEMA[key] for item in data[key]), key
    for key in ("mttr", "time_to_first_action"):
        assert set(data[key]) == SCHEMA["mttr"]
        assert all(set(b) == SCHEMA["histogram"] for b in data[key]["histogram"])
    assert data["mttr"]["p50_s"] == 1800
    assert cli_store.ids["old"] not in {i["id"] for i in data["incidents"]}


def test_csv_writes_one_file_per_table(cli_store: Filled, tmp_path: Path) -> None:
    invoke("--csv", str(tmp_path / "csv"))

    def read(stem: str) -> list[list[str]]:
        with (tmp_path / "csv" / f"{stem}.csv").open(newline="") as f:
            return list(csv.reader(f))

    lists = ["incidents", "by_status", "by_classification", "by_action", "by_rule", "nodes", "gpus"]
    lists += ["goodput_lost", "approvals", "approvers", "held"]
    assert {p.stem for p in (tmp_path / "csv").iterdir()} == {*lists, "distributions", "histograms"}
    data = json.loads(invoke("--json").stdout)
    for stem in lists:
        assert read(stem)[0] == list(data[stem][0]), stem  # the JSON's keys, in its order
    assert read("by_rule")[0] == ["value", "incidents"]
    assert read("distributions")[0] == ["measure", "incidents", "p50_s", "p90_s", "p99_s", "max_s"]
    assert read("distributions")[1][:3] == ["mttr", "3", "1800.0"]
    assert read("histograms")[0] == ["measure", "from_s", "to_s", "incidents"]
    assert ["carol", "1", "0"] in read("approvers")
    bus = next(row for row in read("incidents") if row[0] == cli_store.ids["bus"])
    assert bus[9] == "j-1" and bus[10] == "1800.0"


def test_html_is_one_page_with_its_charts_inline(cli_store: Filled, tmp_path: Path) -> None:
    page_path = tmp_path / "report.html"
    result = invoke("--html", str(page_path))
    assert f"wrote {page_path}" in result.stderr
    page = page_path.read_text()
    for section in ("summary", "counts", "durations", "nodes", "goodput", "approvals", "incidents"):
        assert f'<section id="{section}">' in page
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 4
    assert all(base64.b64decode(i).startswith(b"\x89PNG") for i in images)
    assert 'src="http' not in page and "<script" not in page  # nothing fetched when opened
    assert "carol" in page and "xid-fallen-off-bus" in page and cli_store.ids["mem"] in page


def test_html_without_matplotlib_keeps_its_tables_and_says_why(
    cli_store: Filled, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # importing it raises ImportError
    result = invoke("--html", str(tmp_path / "report.html"))
    assert "pip install 'gpu-medic[plot]'" in result.stderr
    page = (tmp_path / "report.html").read_text()
    assert "<img" not in page and page.count("Chart left out: charts need matplotlib") == 4
    assert "carol" in page and "Incidents per duration" in page  # the histograms, as a table


def test_terminal_summary(cli_store: Filled) -> None:
    out = invoke().stdout
    assert "5 incidents, opened since" in out
    for text in ("xid-fallen-off-bus", "MTTR", "30.0 min", "gpu-001", "carol", "dave", "j-1"):
        assert text in out, text


def test_a_bad_since_is_a_usage_error(cli_store: Filled) -> None:
    assert runner.invoke(app, ["report", "--since", "last week"]).exit_code == 2
