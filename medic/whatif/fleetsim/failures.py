"""What fails, how often, what our sources then report, and what would fix it.

Root causes and their weights are Table 5 of "The Llama 3 Herd of Models" (Meta, 2024): the 419
unexpected interruptions of a 54-day, 16,384-GPU pre-training run. Each cause shows itself as
one or more signatures: the events our sources (node agent, DCGM health watches, the training
job's hooks) would write for it. What a remediation does to the fault is the `Nature` of the
signature: a restart clears a software fault but no reset revives a dead GPU, and no node
action fixes a switch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from medic.events import EventKind
from medic.policy import Action


class Nature(StrEnum):
    """The least that clears the fault."""

    RESTART = "restart"  # restarting the job (software, a transient hang)
    RESET = "reset"  # a GPU reset, a reboot or a replacement
    REBOOT = "reboot"  # a reboot or a replacement
    REPLACE = "replace"  # only new hardware
    NETWORK = "network"  # only the network team's repair: no node action helps


# What each action clears, beyond restarting the job (which clears RESTART faults every time).
CLEARS: dict[Action, frozenset[Nature]] = {
    Action.RESET_GPU: frozenset({Nature.RESET}),
    Action.REBOOT: frozenset({Nature.RESET, Nature.REBOOT}),
    Action.REPLACE: frozenset({Nature.RESET, Nature.REBOOT, Nature.REPLACE}),
}

Detect = Literal["kernel", "health", "crash", "hang"]
# Where an event comes from: the failing GPU's node, or every node under its leaf switch.
Where = Literal["node", "switch"]


@dataclass(frozen=True, slots=True)
class EventSpec:
    kind: EventKind
    attributes: dict[str, Any]
    gpu: bool = True  # about the failing GPU (else about the node)
    where: Where = "node"


@dataclass(frozen=True, slots=True, eq=False)  # one object per signature: compared and hashed by identity
class Signature:
    name: str
    weight: float  # within its cause
    events: tuple[EventSpec, ...]
    detect: Detect
    nature: Nature
    persistent: float = 0.0  # chance a RESET or REBOOT fault is in fact beyond them (needs REPLACE)
    fails_from: tuple[int, str] | None = None  # the lowest DCGM level that fails while the fault is there


@dataclass(frozen=True, slots=True)
class Cause:
    name: str
    interruptions: int  # in Meta's 54 days
    signatures: tuple[Signature, ...]


def _xid(code: int, **extra: Any) -> EventSpec:
    return EventSpec(EventKind.XID, {"code": code, **extra})


CRASH = EventSpec(EventKind.JOB_CRASH, {"exit_code": 134}, gpu=False)
APP_CRASH = EventSpec(EventKind.JOB_CRASH, {"exit_code": 1}, gpu=False)
TIMEOUT = EventSpec(EventKind.NCCL_TIMEOUT, {}, gpu=False)
UNREACHABLE = EventSpec(EventKind.NODE_UNREACHABLE, {}, gpu=False)
NAN = EventSpec(EventKind.NAN_LOSS, {}, gpu=False)


def _host(name: str, interruptions: int) -> Cause:
    """A server part (power supply, CPU, ...): the node stops answering and must be repaired."""
    return Cause(
        name,
        interruptions,
        (Signature("node unreachable", 1, (UNREACHABLE, CRASH), "health", Nature.REPLACE),),
    )


CAUSES: tuple[Cause, ...] = (
    Cause(
        "faulty GPU",
        148,
        (
            Signature(
                "XID 79 fallen off the bus",
                6,
                (_xid(79), TIMEOUT, CRASH),
                "kernel",
                Nature.REBOOT,
                persistent=0.4,
                fails_from=(1, "DCGM_FR_PCI_REPLAY_RATE"),
            ),
            Signature(
                "GPU missing",
                2,
                (EventSpec(EventKind.GPU_MISSING, {"expected": 8, "found": 7}, gpu=False), CRASH),
                "health",
                Nature.REBOOT,
                persistent=0.4,
                fails_from=(1, "DCGM_FR_PCI_REPLAY_RATE"),
            ),
            Signature(
                "XID 109 context-switch timeout",
                2,
                (_xid(109), CRASH),
                "kernel",
                Nature.RESET,
                persistent=0.3,
                fails_from=(3, "DCGM_FR_PCI_REPLAY_RATE"),
            ),
        ),
    ),
    Cause(
        "GPU HBM3 memory",
        72,
        (
            Signature(
                "XID 48 double-bit ECC",
                5,
                (_xid(48), EventSpec(EventKind.ECC, {"dbe": 1, "sbe": 4}), CRASH),
                "kernel",
                Nature.RESET,
                persistent=0.2,
                fails_from=(2, "DCGM_FR_FAULTY_MEMORY"),
            ),
            Signature(
                "XID 95 uncontained ECC",
                2,
                (_xid(95), CRASH),
                "kernel",
                Nature.RESET,
                persistent=0.2,
                fails_from=(2, "DCGM_FR_FAULTY_MEMORY"),
            ),
            Signature(
                "XID 94 contained ECC, row remap pending",
                2,
                (_xid(94, row_remap_pending=True), CRASH),
                "kernel",
                Nature.RESET,
                fails_from=(2, "DCGM_FR_PENDING_ROW_REMAP"),
            ),
            Signature(
                "XID 64 row remap failure",
                1,
                (_xid(64, row_remap_failure=True), CRASH),
                "kernel",
                Nature.REPLACE,
                fails_from=(1, "DCGM_FR_ROW_REMAP_FAILURE"),
            ),
        ),
    ),
    Cause(
        "software bug",
        54,
        (
            Signature("NaN loss", 2, (NAN, APP_CRASH), "crash", Nature.RESTART),
            Signature("job crash", 2, (APP_CRASH,), "crash", Nature.RESTART),
            Signature("XID 13 graphics exception", 1, (_xid(13), APP_CRASH), "kernel", Nature.RESTART),
        ),
    ),
    Cause(
        "network switch/cable",
        35,
        (
            Signature(
                "switch down: timeouts under one switch",
                1,
                (EventSpec(EventKind.NCCL_TIMEOUT, {}, gpu=False, where="switch"),),
                "hang",
                Nature.NETWORK,
            ),
            Signature("cable flap: one node times out", 1, (TIMEOUT,), "hang", Nature.RESTART),
        ),
    ),
    Cause(
        "host maintenance",
        32,
        (Signature("node unreachable", 1, (UNREACHABLE, CRASH), "health", Nature.REBOOT),),
    ),
    Cause(
        "GPU SRAM memory",
        19,
        (
            Signature(
                "DCGM SRAM threshold",
                1,
                (EventSpec(EventKind.DCGM_HEALTH, {"error_id": "DCGM_FR_SRAM_THRESHOLD"}), CRASH),
                "health",
                Nature.REPLACE,
                fails_from=(2, "DCGM_FR_SRAM_THRESHOLD"),
            ),
        ),
    ),
    Cause(
        "GPU system processor",
        17,
        (
            Signature(
                "XID 119 GSP timeout",
                1,
                (_xid(119), CRASH),
                "kernel",
                Nature.RESET,
                persistent=0.2,
                fails_from=(3, "DCGM_FR_XID_ERROR"),
            ),
        ),
    ),
    Cause(
        "NIC",
        7,
        (
            Signature(
                "link down, collectives time out",
                1,
                (EventSpec(EventKind.HEALTH_CHECK, {"check": "ib_link", "message": "port down"}), TIMEOUT),
                "hang",
                Nature.REPLACE,
            ),
        ),
    ),
    Cause(
        "NCCL watchdog timeout",
        7,
        (Signature("collective timeout", 1, (TIMEOUT,), "hang", Nature.RESTART),),
    ),
    Cause(
        "silent data corruption",
        6,
        (
            Signature(
                "NaN loss on a bad GPU",
                1,
                (EventSpec(EventKind.NAN_LOSS, {}), APP_CRASH),
                "crash",
                Nature.REPLACE,
                fails_from=(3, "DCGM_FR_MEMORY_MISMATCH"),
            ),
        ),
    ),
    Cause(
        "GPU thermal interface + sensor",
        6,
        (
            Signature(
                "hot, throttled, straggling",
                1,
                (
                    EventSpec(
                        EventKind.THERMAL, {"temperature_c": 92.0, "throttle_reasons": ["hw_slowdown"]}
                    ),
                    *(EventSpec(EventKind.STRAGGLER, {"step_time_ratio": r}) for r in (1.3, 1.4, 1.5)),
                ),
                "health",
                Nature.REPLACE,
                fails_from=(3, "DCGM_FR_CLOCKS_EVENT_THERMAL"),
            ),
        ),
    ),
    _host("SSD", 3),
    _host("power supply", 3),
    _host("server chassis", 2),
    _host("IO expansion board", 2),
    Cause("dependency", 2, (Signature("job crash", 1, (APP_CRASH,), "crash", Nature.RESTART),)),
    _host("CPU", 2),
    _host("system memory", 2),
)

TABLE_INTERRUPTIONS = sum(c.interruptions for c in CAUSES)  # 419
_CAUSE_WEIGHTS = [c.interruptions for c in CAUSES]


def arrivals(rate_per_s: float, horizon_s: float, rng: random.Random) -> list[float]:
    """Times of a Poisson process of `rate_per_s` events per second on [0, horizon_s)."""
    times: list[float] = []
    t = rng.expovariate(rate_per_s)
    while t < horizon_s:
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def draw(rng: random.Random) -> tuple[Cause, Signature, Nature]:
    """A root cause by its weight in Meta's table, one of its signatures, and what it will take to fix."""
    cause = rng.choices(CAUSES, _CAUSE_WEIGHTS)[0]
    signature = rng.choices(cause.signatures, [s.weight for s in cause.signatures])[0]
    nature = signature.nature
    if signature.persistent and rng.random() < signature.persistent:
        nature = Nature.REPLACE
    return cause, signature, nature
