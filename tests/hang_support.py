"""What `medic serve` makes of a job whose ranks all stall inside one collective: the stall reports the
reference job's hooks send (one rank per node), through the differential (medic/culprit.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from factories import fault_event

from medic.culprit import differential
from medic.events import FaultEvent


def hung_job(job: str, nodes: list[str], iteration: int = 1_234, collective: int = 812) -> list[FaultEvent]:
    """One derived `nccl_timeout` per node, named from the ranks' stalls 30 s after they stopped."""
    at = datetime.now(UTC) - timedelta(seconds=30)
    stalls = [
        fault_event(
            "health_check",
            id=f"stall-{job}-r{rank}",
            job=job,
            rank=rank,
            node=node,
            at=at,
            seconds=rank,
            iteration=iteration,
            attributes={
                "check": "stall",
                "collective_seq": collective,
                "in_collective": True,
                "world_size": len(nodes),
            },
        )
        for rank, node in enumerate(nodes)
    ]
    named = differential(stalls)
    assert [e.node for e in named] == nodes and all(e.attributes["evidence"] == "together" for e in named)
    return named
