"""The incident's Slack message says why its straggler is slow and attaches both traces (issue 39).

`first_message` is the one place the message's body is built (medic/flows/remediate.py); it is called here as
the flow calls it, with the incident's events as the store gives them back, without a flow run.
"""

from __future__ import annotations

from checkout import REPO_ROOT
from factories import fault_event

from medic.artifacts import Artifact
from medic.facts import facts_of
from medic.flows.remediate import first_message
from medic.incidents import Incident
from medic.integrations.registry import Backends
from medic.integrations.slack.blocks import message_blocks
from medic.policy import decide
from medic.store import Store
from medic.tasks.runtime.process import Runtime, configure
from medic.tasks.triage import Triage

SUSPECT, PEER = "/shared/medic/llm-r2-profile.json", "/shared/medic/llm-r0-profile.json"
VERDICT = {
    "step_time_ratio": 1.6,
    "straggler_cause": "software-input",
    "straggler_cause_confidence": 0.99,
    "straggler_cause_hardware": False,
    "straggler_cause_where": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
    "straggler_cause_evidence": [
        {
            "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
            "category": "input",
            "grew_s": 0.0052,
            "ratio": 6.4,
        }
    ],
    "straggler_cause_peer_artifact": PEER,
    "artifact": SUSPECT,
    "profile_event": "p-1",
}


def test_the_message_names_the_cause_where_and_what_grew_and_attaches_both_traces(
    sqlite_store: Store, sim_backends: Backends
) -> None:
    runtime = configure(Runtime(sqlite_store, sim_backends, REPO_ROOT / "policies" / "default.yaml"))
    events = [
        fault_event("straggler", id=f"s{m}", minutes=m, node="node-b", job="llm", rank=2) for m in (0, 1)
    ]
    events.append(
        fault_event("straggler", id="s2", minutes=2, node="node-b", job="llm", rank=2, attributes=VERDICT)
    )
    slow = Incident(id="inc-slow", node="node-b", events=events)
    runtime.store.record_accepted(events)
    runtime.store.open_incident(slow)
    decision = decide(runtime.policy().policy, facts_of(slow))
    triaged = Triage(
        incident=slow.id,
        node="node-b",
        nodes=["node-b"],
        subject="node-b",
        gpu=None,
        jobs=["llm"],
        owner="alice",
        channel="@alice",
        fleet_size=8,
        decision=decision,
    )

    message = first_message(triaged, decision, runtime.store.incident_events(slow.id))

    assert message.title == "Software fault on node-b: none"
    assert "straggler cause software-input (confidence 0.99) in enumerate(DataLoader)" in message.body
    assert message.body.endswith(
        "Why it is slow: software-input (confidence 0.99) in "
        "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__\n"
        "```\nenumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__ +5.2 ms/step (x6.4)\n```"
    )
    assert message.recommend and "data loader" in message.recommend[0]
    assert message.artifacts == (
        Artifact("profile of rank 2 on node-b", SUSPECT),
        Artifact("profile of a healthy peer, against rank 2 on node-b", PEER),
    )
    shown = "\n".join(
        b["text"]["text"] for b in message_blocks(message) if b["type"] == "section" and "text" in b
    )
    assert (
        "```\nenumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__ +5.2 ms/step (x6.4)\n```" in shown
    )
    assert f"profile of a healthy peer, against rank 2 on node-b: `{PEER}`" in shown
