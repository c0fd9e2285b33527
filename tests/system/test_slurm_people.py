"""What people did, on a real Slurm cluster (docs/decisions/0019-human-actions-as-events.md): an admin's
`scontrol` drain, resume and reboot are stored as `node_state` events with the reason and the user Slurm
keeps; GPU Medic's own drain (`medic: ...`) and resume are not taken for a person's; nothing is remediated.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import slurm_cluster
from slurm_cluster import Cluster, until

from medic.apps.server.people import PeopleWatch, ours_in
from medic.events import FaultEvent, event_time
from medic.integrations.slurm import SlurmScheduler
from medic.integrations.slurm.watch import NodeWatch
from medic.statuses import ActionStatus
from medic.store import Store

# tests/slurm_cluster.py's fixtures: a cluster of this module's own.
cluster = slurm_cluster.cluster
slurm = slurm_cluster.slurm
EVER = (datetime(2000, 1, 1, tzinfo=UTC), datetime(2100, 1, 1, tzinfo=UTC))


@pytest.fixture
def settled(slurm: Cluster) -> Iterator[Cluster]:
    yield slurm
    slurm.settle()


def changes(store: Store) -> list[tuple[str, str, str | None, str | None]]:
    stored: list[FaultEvent] = sorted(
        (e for e in store.events_between(*EVER) if e.kind == "node_state"), key=lambda e: e.id
    )
    return [
        (e.node, e.attributes["change"], e.attributes.get("reason"), e.attributes.get("reason_set_by"))
        for e in stored
    ]


def test_an_admins_drain_resume_and_reboot_are_stored_ours_are_not_and_nothing_is_remediated(
    settled: Cluster, sqlite_store: Store
) -> None:
    watch = PeopleWatch(sqlite_store, NodeWatch(settled.cli, ours_in(sqlite_store)))
    assert watch.poll() == 0  # the baseline
    ours = SlurmScheduler(settled.cli)

    settled.run("scontrol", "update", "nodename=gpu-node-1", "state=drain", "reason=admin: bad fan")
    ours.drain("gpu-node-2", "medic: xid 79 on GPU 3 incident inc-people")
    assert watch.poll() == 1
    (drain,) = [e for e in sqlite_store.events_between(*EVER) if e.kind == "node_state"]
    assert (drain.source, drain.node, drain.attributes["change"]) == ("slurm", "gpu-node-1", "drain")
    assert (drain.attributes["reason"], drain.attributes["reason_set_by"]) == ("admin: bad fan", "root")
    assert event_time(drain.time) == drain.attributes["reason_set_at"]  # Slurm's time, to the second
    assert drain.time <= datetime.fromisoformat(drain.attributes["seen_at"])

    settled.run("scontrol", "update", "nodename=gpu-node-1", "state=resume")
    # Our resume of our drain: the intent is written before Slurm is asked, as medic/tasks/act.py does.
    sqlite_store.claim_action("inc-people:gpu-node-2:resume", "inc-people", "gpu-node-2", "resume")
    ours.resume("gpu-node-2")
    sqlite_store.finish_action("inc-people:gpu-node-2:resume", ActionStatus.SUCCEEDED)
    assert watch.poll() == 1

    settled.run("scontrol", "reboot", "reason=admin: firmware", "gpu-node-3")

    def rebooted() -> bool:
        watch.poll()
        return ("gpu-node-3", "reboot", None, None) in changes(sqlite_store)

    until(rebooted, "gpu-node-3 back with a later BootTime")
    seen = changes(sqlite_store)
    assert seen[:2] == [
        ("gpu-node-1", "drain", "admin: bad fan", "root"),
        ("gpu-node-1", "resume", "admin: bad fan", "root"),  # the hold it ended: Slurm keeps no resumer
    ]
    assert ("gpu-node-3", "reboot_requested", "admin: firmware", "root") in seen
    assert not [c for c in seen if c[0] == "gpu-node-2"]  # GPU Medic's drain and resume are not people's
    assert sqlite_store.find_incidents() == [] and sqlite_store.undispatched_events() == []
