"""In a burst the containments go first (medic/flows/live.py): a few at a time, those whose own events say
"take the node out" before the rest, and new flow runs wait for them (BENCHMARKS.md, "At fleet
scale")."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from factories import fault_event

from medic.flows.containment import Turns
from medic.flows.live import LiveDispatcher
from medic.incidents import Incident
from medic.tasks.runtime.process import Runtime


def test_turns_go_by_priority_then_arrival_and_a_cancelled_waiter_frees_nothing_twice() -> None:
    entered: list[str] = []

    async def run() -> None:
        turns = Turns(1)
        gate = asyncio.Event()

        async def one(name: str, priority: int) -> None:
            async with turns.turn(priority):
                entered.append(name)
                await gate.wait()

        first = asyncio.create_task(one("first", 1))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(one(n, p)) for n, p in (("late-a", 1), ("urgent", 0), ("late-b", 1))]
        gone = asyncio.create_task(one("cancelled", 0))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *waiting)
        # Every turn was given back: one more goes in at once.
        async with turns.turn(1):
            entered.append("after")

    asyncio.run(run())
    assert entered == ["first", "urgent", "late-a", "late-b", "after"]


def test_an_incident_that_will_take_its_node_out_is_contained_first(
    runtime: Runtime, live_dispatcher: Callable[..., LiveDispatcher]
) -> None:
    dispatcher = live_dispatcher(runtime)
    fatal = Incident(id="inc-79", node="gpu-node-1", events=[fault_event("xid", node="gpu-node-1")])
    quiet = Incident(
        id="inc-13",
        node="gpu-node-2",
        events=[fault_event("xid", node="gpu-node-2", attributes={"code": 13})],
    )
    assert (dispatcher.containment.urgency(fatal), dispatcher.containment.urgency(quiet)) == (0, 1)
