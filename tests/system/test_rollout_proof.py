"""The rollout proof on a real Slurm cluster (issue 36, docs/rollout.md#the-proof): `medic serve` with the
group `canary` (gpu-node-[1-3]) in observe and `rest` (gpu-node-4) in remediate, XID 79s injected, and a
scripted on-call who answers with `scontrol` as people do: the report's counts are the script's ground
truth, GPU Medic never touches a canary node, and the remediate group is remediated as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import httpx
import pytest
import slurm_cluster
import yaml
from checkout import REPO_ROOT
from serve_process import TOKEN, free_port, server_process
from slurm_cluster import Cluster
from waiting import until

from medic.store import Store

pytestmark = pytest.mark.system

cluster = slurm_cluster.cluster
slurm = slurm_cluster.slurm

CANARY = ["gpu-node-1", "gpu-node-2", "gpu-node-3"]
REMEDIATED = "gpu-node-4"
EVER = (datetime(2000, 1, 1, tzinfo=UTC), datetime(2100, 1, 1, tzinfo=UTC))


@pytest.fixture
def settled(slurm: Cluster) -> Iterator[Cluster]:
    yield slurm
    slurm.settle()


def _policy(directory: Path) -> Path:
    data = yaml.safe_load((REPO_ROOT / "policies" / "default.yaml").read_text(encoding="utf-8"))
    data["guardrails"] = {}  # one reboot at a time here; the guardrails are tested elsewhere
    data["groups"] = [
        {"name": "canary", "select": {"hostlist": ["gpu-node-[1-3]"]}, "mode": "observe"},
        {"name": "rest", "select": {"hostlist": ["gpu-node-4"]}, "mode": "remediate"},
    ]
    path = directory / "policy.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _post_xid79(port: int, node: str) -> None:
    event = {
        "id": f"proof-{uuid.uuid4().hex}",
        "time": datetime.now(UTC).isoformat(),
        "source": "agent",
        "kind": "xid",
        "node": node,
        "gpu": 0,
        "attributes": {"code": 79},
    }
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/events",
        json=event,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert response.status_code < 300 and response.json()["accepted"] == 1, response.text


def _settled_incident(store: Store, node: str) -> str | None:
    found = [i for i in store.find_incidents(node=node) if i.status in ("closed", "escalated")]
    return found[0].id if found else None


def _changes(store: Store) -> set[tuple[str, str]]:
    return {(e.node, e.attributes["change"]) for e in store.events_between(*EVER) if e.kind == "node_state"}


def test_observe_beside_remediate_with_a_scripted_on_call(settled: Cluster, tmp_path: Path) -> None:
    started = time.monotonic()
    database = tmp_path / "medic.db"
    env = {
        "MEDIC_BACKENDS": "sim",  # diagnostics, checkpoints, notifier
        "MEDIC_SCHEDULER": "slurm",
        "MEDIC_PROVIDER": "slurm",
        "MEDIC_POLICY": str(_policy(tmp_path)),
        "MEDIC_HOME": str(tmp_path),
        "MEDIC_SLURM_WATCH_SECONDS": "5",
        "SLURM_CONF": str(settled.base / "etc" / "slurm.conf"),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    saved_api = os.environ.pop("PREFECT_API_URL", None)
    port = free_port()
    store = Store(f"sqlite:///{database}")
    touched_by_us: list[str] = []

    def canary_untouched() -> None:
        for n in settled.cli.nodes():
            if n.name in CANARY and n.reason and n.reason.startswith("medic:"):
                touched_by_us.append(f"{n.name}: {n.reason}")

    try:
        with server_process(database, port, env):
            for node in ["gpu-node-1", "gpu-node-2", REMEDIATED]:
                _post_xid79(port, node)
            decided = {
                node: until(partial(_settled_incident, store, node), f"a decision on {node}")
                for node in ["gpu-node-1", "gpu-node-2"]
            }
            # Slurm keeps people's times to the second: the on-call answers after the decisions' second.
            time.sleep(1.1)

            # The scripted on-call. Ground truth for the canary group:
            #  gpu-node-1: XID 79, people drain and reboot it    -> agreed (GPU Medic would have rebooted)
            #  gpu-node-2: XID 79, people do nothing              -> would have acted where people did not
            #  gpu-node-3: no fault, people drain it, then resume -> people acted where GPU Medic saw nothing
            settled.run("scontrol", "update", "nodename=gpu-node-1", "state=drain", "reason=oncall: xid 79")
            settled.run("scontrol", "reboot", "reason=oncall: xid 79", "gpu-node-1")
            settled.run(
                "scontrol", "update", "nodename=gpu-node-3", "state=drain", "reason=oncall: fan noise"
            )

            def on_call_seen() -> bool:
                canary_untouched()
                return {("gpu-node-1", "reboot"), ("gpu-node-3", "drain")} <= _changes(store)

            until(on_call_seen, "the watch storing the on-call's drain and reboot")
            settled.run("scontrol", "update", "nodename=gpu-node-1", "state=resume")
            settled.run("scontrol", "update", "nodename=gpu-node-3", "state=resume")

            def remediated() -> str | None:
                canary_untouched()
                found = store.find_incidents(node=REMEDIATED)
                return found[0].id if found and found[0].status in ("closed", "escalated") else None

            ours = until(remediated, f"{REMEDIATED} remediated")
            until(
                lambda: {("gpu-node-1", "resume"), ("gpu-node-3", "resume")} <= _changes(store),
                "the on-call's resumes stored",
            )
            canary_untouched()
    finally:
        if saved_api is not None:
            os.environ["PREFECT_API_URL"] = saved_api

    # The remediate group: as before, drained, rebooted, verified and returned to service.
    detail = store.incident_detail(ours)
    assert detail is not None
    assert (detail.incident.action, detail.incident.status) == ("reboot", "closed"), detail.incident.outcome
    assert {a.action: a.status for a in detail.actions} == {
        "drain": "succeeded",
        "reboot": "succeeded",
        "resume": "succeeded",
    }
    node4 = next(n for n in settled.cli.nodes() if n.name == REMEDIATED)
    assert not node4.flags & {"DRAIN", "FAIL"}, node4
    # Our own drain, reboot and resume of gpu-node-4 are never taken for people's.
    assert not [c for c in _changes(store) if c[0] == REMEDIATED]

    # The observe group: decided, never touched.
    assert touched_by_us == []
    for node in ["gpu-node-1", "gpu-node-2"]:
        canary = store.incident_detail(decided[node])
        assert canary is not None and canary.actions == [], canary
    assert not [i for i in store.find_incidents(node="gpu-node-3")]

    # The report, as an SRE runs it, against serve's store.
    report_env = os.environ | env | {"MEDIC_DATABASE_URL": f"sqlite:///{database}"}
    report_env.pop("PREFECT_API_URL", None)
    medic = Path(sys.executable).parent / "medic"
    done = subprocess.run(
        [str(medic), "rollout", "report", "--json", "--since", "1h"],
        env=report_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    groups = {g["name"]: g for g in json.loads(done.stdout)["groups"]}
    canary_group = groups["canary"]
    assert canary_group["mode_now"] == "observe"
    truth = {"would_have": 2, "agreed": 1, "disagreed": 0, "pending": 1, "false_alarm": 0}
    assert {k: canary_group[k] for k in truth} == truth, canary_group
    verdicts = {p["node"]: p["verdict"] for p in canary_group["pairs"]}
    assert verdicts == {"gpu-node-1": "agreed", "gpu-node-2": "pending"}
    assert canary_group["destructive_disagreements"] == 0
    # People's drain of gpu-node-3, which GPU Medic saw nothing before: one miss of ours, in the group the
    # policy's hostlist names the node in (docs/rollout.md#verdicts), though GPU Medic never decided on it.
    assert canary_group["our_misses"] == 1 and "*" not in groups, groups
    (missed,) = canary_group["missed"]
    assert [e.node for e in store.events_between(*EVER) if e.id == missed] == ["gpu-node-3"]
    rest = groups["rest"]
    assert (rest["would_have"], rest["modes"][0]["mode"]) == (0, "remediate")
    print(f"rollout proof took {time.monotonic() - started:.1f} s")
