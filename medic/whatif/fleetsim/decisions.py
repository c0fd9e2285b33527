"""The real policy engine deciding simulated incidents, once per distinct shape.

Every decision comes from `decide` on `Facts` that `facts_of` distilled from validated
`FaultEvent`s grouped by `correlate`, as `medic triage` does. What those events look like
depends only on the signature, the node's recent history (our remediations in the last 7
days, earlier episodes of the same fault in the last 24 h), whether the node is out of
service, and the diagnostics run so far: that tuple is the cache key, so a 54-day run of
thousands of incidents builds about a hundred incidents and decides each once. Node names,
times and ids are those of a canonical incident; the guardrails, which depend on the fleet at
the moment, are applied by the caller to each decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from medic.context import Context
from medic.events import EventKind, FaultEvent
from medic.facts import OUR_SOURCE, facts_of
from medic.incidents import Scope, correlate
from medic.policy import Decision, LoadedPolicy, decide
from medic.whatif.fleetsim.failures import Signature

NODE = "gpu-node-1"
SWITCH = "leaf-1"
JOB = "pretrain"
GPU = 3
T0 = datetime(2026, 1, 8, tzinfo=UTC)
# (level, "pass" | "fail", the DCGM error of a failed run or "")
Diagnostic = tuple[int, str, str]


@dataclass(frozen=True, slots=True)
class Shape:
    signature: Signature
    out_of_service: bool
    recent_remediations: int
    earlier_episodes: int
    diagnostics: tuple[Diagnostic, ...]


@dataclass(slots=True)
class Decider:
    loaded: LoadedPolicy
    switch_size: int
    decided: int = 0  # incidents built and decided by the engine
    asked: int = 0
    # Rules compare history and counts with thresholds: beyond the policy's highest, every value
    # decides alike, so shapes are capped there and the cache stays small.
    _history_cap: int = field(init=False, repr=False)
    _episodes_cap: int = field(init=False, repr=False)
    _cache: dict[Shape, tuple[Decision, Scope]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        whens = [rule.when for rule in self.loaded.policy.rules]
        self._history_cap = max(
            (
                n
                for w in whens
                for n in (w.recent_remediations_at_least or 0, (w.recent_remediations_at_most or 0) + 1)
            ),
            default=0,
        )
        self._episodes_cap = max((c.at_least for w in whens for c in w.count or ()), default=0)

    def decide(self, shape: Shape) -> tuple[Decision, Scope]:
        """The policy's decision on an incident of this shape, and whether it is one node's or a switch's."""
        shape = Shape(
            shape.signature,
            shape.out_of_service,
            min(shape.recent_remediations, self._history_cap),
            min(shape.earlier_episodes, self._episodes_cap),
            shape.diagnostics,
        )
        self.asked += 1
        hit = self._cache.get(shape)
        if hit is None:
            hit = self._cache[shape] = self._decide(shape)
            self.decided += 1
        return hit

    def _decide(self, shape: Shape) -> tuple[Decision, Scope]:
        policy = self.loaded.policy
        events = _events(shape.signature, T0, 0, self.switch_size)
        events += [
            _event(
                f"d{i}",
                T0 + timedelta(minutes=1 + i),
                EventKind.DIAGNOSTIC,
                NODE,
                source=OUR_SOURCE,
                attributes={"level": level, "result": result, "error_ids": [error] if error else []},
            )
            for i, (level, result, error) in enumerate(shape.diagnostics)
        ]
        history = [
            _event(
                f"h{i}",
                T0 - timedelta(hours=i + 1),  # all within the 7 days that count
                EventKind.REMEDIATION,
                NODE,
                source=OUR_SOURCE,
                attributes={"action": "reboot"},
            )
            for i in range(shape.recent_remediations)
        ]
        # Earlier episodes of the same fault on the same GPU, an hour apart: what count rules
        # (`distinct: episodes`, scope gpu) look for in the cluster's recent events.
        earlier = [
            event
            for k in range(1, shape.earlier_episodes + 1)
            for event in _events(shape.signature, T0 - timedelta(hours=k), k, self.switch_size)
        ]
        sizes = {SWITCH: self.switch_size}
        window = timedelta(minutes=policy.defaults.incident_window_minutes)
        # Without a switch rule, timeouts under a switch are one incident per node: decide the failing node's.
        incident = next(
            i for i in correlate(events + history, window, policy.storms(sizes)) if NODE in i.nodes
        )
        context = Context(earlier + events, switch_sizes=sizes)
        facts = facts_of(incident, out_of_service=shape.out_of_service, context=context)
        return decide(policy, facts, self.loaded.sha256), incident.scope


def _event(
    id: str, time: datetime, kind: EventKind, node: str, *, source: str = "agent", **fields: Any
) -> FaultEvent:
    return FaultEvent(id=id, time=time, source=source, kind=kind, node=node, switch=SWITCH, **fields)


def _events(signature: Signature, start: datetime, episode: int, switch_size: int) -> list[FaultEvent]:
    """The events our sources write for one episode of the fault, a few seconds apart (episode 0:
    the incident's own; a NaN of another episode is at another step, as a faulty GPU's would be)."""
    events = []
    storm_nodes = max(4, switch_size // 2)  # half a switch: what a dead leaf switch looks like
    for i, spec in enumerate(signature.events):
        nodes = [f"gpu-node-{n}" for n in range(1, storm_nodes + 1)] if spec.where == "switch" else [NODE]
        for n, node in enumerate(nodes):
            events.append(
                _event(
                    f"e{episode}-{i}-{n}",
                    start + timedelta(seconds=2 * i + n),
                    spec.kind,
                    node,
                    source="job" if spec.kind in _FROM_THE_JOB else "agent",
                    gpu=GPU if spec.gpu else None,
                    job=JOB,
                    rank=8 * n + GPU,
                    iteration=1000 + 137 * episode if spec.kind is EventKind.NAN_LOSS else None,
                    attributes=spec.attributes,
                )
            )
    return events


_FROM_THE_JOB = frozenset(
    {EventKind.NAN_LOSS, EventKind.JOB_CRASH, EventKind.NCCL_TIMEOUT, EventKind.STRAGGLER}
)
