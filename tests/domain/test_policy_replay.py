"""`medic policy replay`: the store's incidents decided again with another policy, on the facts recorded
at the time, through the same triage and decide tasks the flows run (docs/policy.md#replay)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from checkout import REPO_ROOT
from factories import fault_event
from groups_support import WATCH, write_grouped
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.context import Context
from medic.events import FaultEvent
from medic.facts import Facts, facts_of
from medic.incidents import correlate
from medic.integrations import registry
from medic.integrations.sim.fleet import SimFleet
from medic.policy import load_policy
from medic.store import Store
from medic.store.migrations import baseline
from medic.store.tables import BreakerRecord
from medic.tasks.decide import decide_incident
from medic.tasks.runtime.process import Runtime, configure
from medic.tasks.triage import triage
from medic.whatif.replay import ChangeLimit, FactsRecord, ReplayReport, facts_from, record_facts, replay

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"
runner = CliRunner()


def incidents_now() -> list[FaultEvent]:
    """Six incidents on six nodes, a few minutes ago: two XID 79 (reboot), an NCCL timeout (diagnose 1),
    a double-bit ECC error (reset_gpu), a NaN loss (none) and a straggler (diagnose 2)."""
    at = datetime.now(UTC) - timedelta(minutes=5)
    return [
        fault_event("xid", node="gpu-node-1", gpu=1, at=at, attributes={"code": 79}),
        fault_event("xid", node="gpu-node-2", gpu=2, at=at, seconds=5, attributes={"code": 79}),
        fault_event("nccl_timeout", node="gpu-node-3", at=at, seconds=10, job="llm"),
        fault_event("ecc", node="gpu-node-4", gpu=0, at=at, seconds=15, attributes={"sbe": 0, "dbe": 2}),
        fault_event("nan_loss", node="gpu-node-5", at=at, seconds=20, job="llm", rank=3, iteration=40),
        *(
            fault_event(
                "straggler", node="gpu-node-6", at=at, seconds=25 + i, attributes={"step_time_ratio": 1.5}
            )
            for i in range(3)
        ),
    ]


def remediate_decisions(store: Store, events: list[FaultEvent], policy: Path = DEFAULT_POLICY) -> list[str]:
    """Store the events, open their incidents and run the flow's triage and decide tasks on each:
    the decisions are recorded as the flows record them (a 40-node fleet: no guardrail is near)."""
    fleet = SimFleet.build(nodes=40)
    configure(Runtime(store, registry.simulated(fleet)[0], policy))
    store.record_accepted(events)
    ids = []
    for incident in correlate(events, timedelta(minutes=10)):
        store.open_incident(incident)
        triage.fn(incident.id)
        decide_incident.fn(incident.id)
        ids.append(incident.id)
    return ids


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Store, list[str]]]:
    """One store for the tests that only read it: recording its decisions is most of their time."""
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('replay') / 'medic.db'}")
    yield store, remediate_decisions(store, incidents_now())
    store.close()


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")


def edited(tmp_path: Path, old: str, new: str) -> Path:
    """A copy of the default policy with one edit."""
    path = tmp_path / "new.yaml"
    shutil.copy(DEFAULT_POLICY, path)
    policy = path.read_text()
    assert old in policy, old
    path.write_text(policy.replace(old, new, 1))
    return path


def run_replay(store: Store, policy: Path, *args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["policy", "replay", str(policy), "--store", store.url, *args])
    return result.exit_code, result.stdout, result.stderr


REBOOT_TO_REPLACE = (
    "      xid: [79]\n    then:\n      classification: hardware\n      action: reboot\n",
    "      xid: [79]\n    then:\n      classification: hardware\n      action: replace\n",
)


def test_the_recorded_facts_are_the_facts_the_engine_saw() -> None:
    events = incidents_now()[:2]
    (incident,) = correlate(events[:1], timedelta(minutes=10))
    context = Context(events, switch_sizes={"leaf-1": 4}, fleet_size=40)
    facts = facts_of(incident, context=context)
    kept = FactsRecord.model_validate(json.loads(json.dumps(record_facts(facts))))
    assert facts_from(kept, {e.id: e for e in events}, context) == facts
    assert kept.fleet_size == 40


def test_every_fact_the_engine_sees_is_recorded() -> None:
    # A field added to Facts must be kept too, or replays would decide on a default instead.
    kept = set(FactsRecord.model_fields)
    assert {f for f in Facts.__dataclass_fields__ if f not in ("events", "context")} <= kept


def test_the_live_path_records_its_facts_and_the_same_policy_changes_nothing(store: Store) -> None:
    ids = remediate_decisions(store, incidents_now())
    detail = store.incident_detail(ids[0])
    assert detail is not None
    assert [d.facts is not None for d in detail.decisions] == [True, True]  # triage, then decide
    facts = detail.decisions[-1].facts
    assert facts is not None
    assert facts["xid_codes"] == [79]
    assert facts["event_ids"] == [e.id for e in detail.events]
    assert facts["fleet_size"] == 40

    report = replay(
        store.replay_history(since=None, lookback=timedelta(hours=1)), load_policy(DEFAULT_POLICY)
    )
    assert (report.incidents, report.decisions, report.changed, report.rebuilt) == (6, 12, 0, 0)
    assert report.changes == [] and report.nodes == [] and report.guardrails == []
    assert {a: (c.before, c.after) for a, c in report.actions.items()} == {
        "diagnose": (2, 2),
        "none": (1, 1),
        "reboot": (2, 2),
        "reset_gpu": (1, 1),
    }


def test_a_job_named_now_is_not_taken_for_the_time_of_deciding(store: Store) -> None:
    # The replay cuts `now` out of the stored facts' JSON: a value "now" before it (here the job's
    # name, in `jobs`) is not that key.
    at = datetime.now(UTC) - timedelta(minutes=5)
    remediate_decisions(
        store, [fault_event("nan_loss", node="gpu-node-1", at=at, job="now", rank=0, iteration=7)]
    )
    report = replay(
        store.replay_history(since=None, lookback=timedelta(hours=1)), load_policy(DEFAULT_POLICY)
    )
    assert (report.incidents, report.decisions, report.changed) == (1, 2, 0)


def test_the_cli_against_the_same_policy_exits_0(recorded: tuple[Store, list[str]]) -> None:
    store, _ = recorded
    code, out, _ = run_replay(store, DEFAULT_POLICY, "--max-changed", "0")
    assert code == 0, out
    assert "Replayed 6 incidents (12 decisions)" in out
    assert "0 changed (0.0%)" in out


def test_a_rule_with_another_action_lists_exactly_its_incidents(
    recorded: tuple[Store, list[str]], tmp_path: Path
) -> None:
    store, ids = recorded
    new = edited(tmp_path, *REBOOT_TO_REPLACE)
    code, out, _ = run_replay(store, new, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["changed"] == 2
    assert [c["incident"] for c in report["changes"]] == ids[:2]  # the two XID 79 incidents
    assert {c["node"] for c in report["changes"]} == {"gpu-node-1", "gpu-node-2"}
    assert report["actions"]["reboot"] == {"before": 2, "after": 0}
    assert report["actions"]["replace"] == {"before": 0, "after": 2}
    assert report["actions"]["reset_gpu"] == {"before": 1, "after": 1}
    assert report["rules"]["xid-fallen-off-bus"] == {"before": 2, "after": 2}
    first = report["changes"][0]
    assert (first["steps_before"], first["steps_after"]) == (["reboot"], ["replace"])
    assert first["command"] == f"medic incident {ids[0]}"
    assert report["nodes"] == []  # a replacement takes the node out as a reboot does


def test_a_changed_incident_links_its_flow_run(recorded: tuple[Store, list[str]], tmp_path: Path) -> None:
    from prefect.settings import PREFECT_UI_URL, temporary_settings

    store, ids = recorded
    store.update_incident(ids[0], flow_run_id="0b5e")
    with temporary_settings({PREFECT_UI_URL: "http://prefect.example"}):
        _, out, _ = run_replay(store, edited(tmp_path, *REBOOT_TO_REPLACE), "--json")
    first, second = json.loads(out)["changes"]
    assert (first["flow_run_id"], first["flow_run_url"]) == (
        "0b5e",
        "http://prefect.example/runs/flow-run/0b5e",
    )
    assert (second["flow_run_id"], second["flow_run_url"]) == (None, None)


@pytest.mark.parametrize(
    ("limit", "code"),
    [("1", 1), ("2", 0), ("30%", 1), ("34%", 0)],  # 2 of 6 incidents changed: 33.3%
)
def test_exit_1_only_over_the_limit(
    recorded: tuple[Store, list[str]], tmp_path: Path, limit: str, code: int
) -> None:
    store, _ = recorded
    got, out, err = run_replay(store, edited(tmp_path, *REBOOT_TO_REPLACE), "--max-changed", limit)
    assert got == code, out + err
    assert ("over the limit" in err) == (code == 1)


def test_a_tighter_guardrail_reports_the_trip(recorded: tuple[Store, list[str]], tmp_path: Path) -> None:
    store, ids = recorded
    new = edited(tmp_path, "max_destructive_per_hour: 20", "max_destructive_per_hour: 1")
    code, out, _ = run_replay(store, new, "--json")
    assert code == 0
    report = json.loads(out)
    # The first reboot goes ahead; the second reboot and the ECC reset are one too many.
    assert [
        (t["incident"], t["guardrail"], t["blocked_action"], t["recorded"]) for t in report["guardrails"]
    ] == [
        (ids[1], "max_destructive_per_hour", "reboot", False),
        (ids[1], "max_destructive_per_hour", "reboot", False),
        (ids[3], "max_destructive_per_hour", "reset_gpu", False),
        (ids[3], "max_destructive_per_hour", "reset_gpu", False),
    ]
    assert report["guardrails"][0]["reason"] == "1 destructive actions in the last hour (limit 1)"
    assert [c["incident"] for c in report["changes"]] == [ids[1], ids[3]]
    assert {n["node"]: (n["taken_out_before"], n["taken_out_after"]) for n in report["nodes"]} == {
        "gpu-node-2": (1, 0),
        "gpu-node-4": (1, 0),
    }
    code, out, _ = run_replay(store, new)
    assert "Guardrails that would have tripped (4)" in out
    assert "max_destructive_per_hour (new)" in out


def first_trips(report: ReplayReport) -> dict[str, str]:
    """Why a guardrail first stopped each incident's decisions."""
    trips: dict[str, str] = {}
    for trip in report.guardrails:
        trips.setdefault(trip.incident, trip.reason)
    return trips


def test_a_breaker_the_replay_opens_closes_when_a_human_closed_the_real_one(
    sqlite_store: Store, tmp_path: Path
) -> None:
    store = sqlite_store
    ids = remediate_decisions(store, incidents_now())
    # Two nodes may go out within 5 minutes: the ECC reset is the third and opens the breaker.
    new = edited(tmp_path, "nodes_percent: 25", "nodes_at_least: 2")
    history = store.replay_history(since=None, lookback=timedelta(hours=1))
    trips = first_trips(replay(history, load_policy(new)))
    assert trips[ids[3]] == "3 nodes taken out within 5 min (limit 2)"
    assert trips[ids[5]] == "the circuit breaker is open; a human must close it"

    ecc_done = max(d.decided_at for d in history.decisions if d.incident == ids[3])
    straggler_first = min(d.decided_at for d in history.decisions if d.incident == ids[5])
    closed = ecc_done + (straggler_first - ecc_done) / 2
    with store.session() as s:
        s.add(BreakerRecord(opened_at=ecc_done, reason="storm", closed_at=closed, closed_by="alice"))
        s.commit()
    history = store.replay_history(since=None, lookback=timedelta(hours=1))
    trips = first_trips(replay(history, load_policy(new)))
    assert trips[ids[5]] == "3 nodes taken out within 5 min (limit 2)"  # closed: it counts again


def test_the_json_schema_is_pinned(recorded: tuple[Store, list[str]], tmp_path: Path) -> None:
    store, _ = recorded
    _, out, _ = run_replay(store, edited(tmp_path, *REBOOT_TO_REPLACE), "--json", "--max-changed", "5%")
    report = json.loads(out)
    assert list(report) == [
        "schema_version",
        "policy",
        "policy_sha256",
        "since",
        "incidents",
        "decisions",
        "rebuilt",
        "skipped",
        "changed",
        "actions",
        "rules",
        "changes",
        "nodes",
        "guardrails",
        "exceeded",
        "groups",  # added within version 1
    ]
    assert report["schema_version"] == 1
    # The default policy has no groups: every incident is the policy's, acted on as recorded.
    assert report["groups"] == [
        {
            "group": "*",
            "mode": "remediate",
            "incidents": 6,
            "changed": 2,
            "acted": {"before": 5, "after": 5},
            "would_have": {"before": 0, "after": 0},
        }
    ]
    assert report["exceeded"] == ["33.3% of incidents changed (limit 5%)"]
    assert list(report["changes"][0]) == [
        "incident",
        "node",
        "decided_at",
        "before",
        "after",
        "steps_before",
        "steps_after",
        "command",
        "flow_run_id",
        "flow_run_url",
        "group",  # added within version 1
        "mode",
    ]
    assert list(report["changes"][0]["before"]) == ["rule", "action", "diagnose_level", "guardrail"]


def test_decisions_recorded_before_facts_were_kept_are_rebuilt_the_same(sqlite_store: Store) -> None:
    store = sqlite_store
    remediate_decisions(store, incidents_now())
    with store.engine.begin() as connection:
        connection.execute(text("UPDATE decisions SET facts = NULL"))
    report = replay(
        store.replay_history(since=None, lookback=timedelta(hours=1)), load_policy(DEFAULT_POLICY)
    )
    assert (report.decisions, report.rebuilt, report.skipped, report.changed) == (12, 12, 0, 0)


def test_since_leaves_out_older_incidents(recorded: tuple[Store, list[str]]) -> None:
    store, _ = recorded
    _, out, _ = run_replay(store, DEFAULT_POLICY, "--json", "--since", "1m")
    assert json.loads(out)["incidents"] == 0


def test_a_broken_policy_exits_2_with_file_and_line(
    recorded: tuple[Store, list[str]], tmp_path: Path
) -> None:
    store, _ = recorded
    broken = edited(tmp_path, "action: reboot", "action: reboooot")
    code, _, err = run_replay(store, broken)
    assert code == 2
    assert f"{broken}:89:15: rules.3.then.action" in err


def test_a_store_from_before_the_facts_column_gains_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    baseline.METADATA.create_all(engine)  # the schema before migrations (medic/store/migrate.py)...
    with engine.begin() as connection:
        connection.execute(text("ALTER TABLE decisions DROP COLUMN facts"))  # ...and before facts
    engine.dispose()
    store = Store(url)  # an upgrade: the column is added, the decisions kept so far have none
    (incident_id,) = remediate_decisions(store, incidents_now()[:1])
    detail = store.incident_detail(incident_id)
    assert detail is not None
    assert [d.facts is not None for d in detail.decisions] == [True, True]
    store.close()


@pytest.mark.parametrize(
    ("text_", "limit"),
    [("5", ChangeLimit(5, False)), ("2.5%", ChangeLimit(2.5, True)), (" 0 ", ChangeLimit(0, False))],
)
def test_change_limits_parse(text_: str, limit: ChangeLimit) -> None:
    assert ChangeLimit.parse(text_) == limit


@pytest.mark.parametrize("bad", ["five", "-1", "1.5", "%"])
def test_a_bad_change_limit_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match=r"limit|number"):
        ChangeLimit.parse(bad)


# --- node groups and modes (docs/policy.md#replay) ----------------------------------------------


def test_each_incident_is_decided_again_in_its_nodes_group_and_mode(
    recorded: tuple[Store, list[str]], tmp_path: Path
) -> None:
    store, _ = recorded
    code, out, _ = run_replay(store, write_grouped(tmp_path / "grouped.yaml"), "--json")
    assert code == 0
    report = json.loads(out)
    rows = {row["group"]: row for row in report["groups"]}
    assert list(rows) == ["watch", "fix", "racks", "*", "?"]
    # The watched nodes' XID 79: the group's own rule, only said; the reboots done are gone.
    watch = rows["watch"]
    assert (watch["mode"], watch["incidents"], watch["changed"]) == ("observe", 2, 2)
    assert (watch["acted"], watch["would_have"]) == ({"before": 2, "after": 0}, {"before": 0, "after": 2})
    assert [(c["node"], c["steps_after"], c["group"], c["mode"]) for c in report["changes"][:2]] == [
        ("gpu-node-1", ["drain"], "watch", "observe"),
        ("gpu-node-2", ["drain"], "watch", "observe"),
    ]
    assert report["changes"][0]["after"]["rule"] == "watch-drain-first"
    # The remediate group's NCCL timeout and ECC error: decided and acted on as before.
    assert rows["fix"]["acted"] == {"before": 2, "after": 2} and rows["fix"]["changed"] == 0
    # gpu-node-5 and 6 may be racks by name, and the store keeps no features: left alone, escalated.
    assert (rows["?"]["mode"], rows["?"]["incidents"], rows["?"]["changed"]) == ("observe", 2, 2)
    assert rows["?"]["acted"] == {"before": 1, "after": 0}
    assert [(c["node"], c["after"]["action"], c["group"], c["mode"]) for c in report["changes"][2:]] == [
        ("gpu-node-5", "escalate", "?", "observe"),
        ("gpu-node-6", "escalate", "?", "observe"),
    ]
    assert (rows["racks"]["incidents"], rows["*"]["incidents"]) == (0, 0)
    # A node only watched is never taken out: the watched nodes' reboots are gone from the fleet.
    taken = {n["node"]: (n["taken_out_before"], n["taken_out_after"]) for n in report["nodes"]}
    assert taken == {"gpu-node-1": (1, 0), "gpu-node-2": (1, 0), "gpu-node-6": (2, 0)}  # two level-2 runs
    code, out, _ = run_replay(store, write_grouped(tmp_path / "grouped.yaml"))
    assert "Node groups" in out
    assert "would have: drain (watch-drain-first)" in out
    assert "escalate (sustained-straggler)" in out and "would have: escalate" not in out


def test_what_was_recorded_in_observe_mode_counts_as_said_not_done(
    sqlite_store: Store, tmp_path: Path
) -> None:
    store = sqlite_store
    remediate_decisions(store, incidents_now(), write_grouped(tmp_path / "watch.yaml", WATCH))
    history = store.replay_history(since=None, lookback=timedelta(hours=1))
    report = replay(history, load_policy(write_grouped(tmp_path / "watch.yaml", WATCH)))
    assert report.changed == 0 and report.nodes == []
    watch = next(row for row in report.groups if row.group == "watch")
    assert (watch.acted.before, watch.would_have.before, watch.would_have.after) == (0, 2, 2)
    # The same incidents under the policy without groups: what was only said would now be done.
    report = replay(history, load_policy(DEFAULT_POLICY))
    (everyone,) = report.groups
    assert (everyone.group, everyone.mode, everyone.incidents) == ("*", "remediate", 6)
    assert (everyone.would_have.before, everyone.would_have.after) == (2, 0)
    assert (everyone.acted.before, everyone.acted.after) == (3, 5)
    taken = {n.node: (n.taken_out_before, n.taken_out_after) for n in report.nodes}
    assert taken == {"gpu-node-1": (0, 1), "gpu-node-2": (0, 1)}
