"""The discrete-event loop: one synchronous training job on the whole fleet, failing and recovering.

Faults arrive as a Poisson process at the fleet's rate (GPUs / GPU MTBF) on a random node of
the job, plus the repeats of faults a remediation left in place. Each stops the job; the
incident then runs as the remediation flow would (docs/simulate.md#method):

1. detection: the signature's latency (an XID in seconds; a hang once the ranks' stall reports name it,
   or when the NCCL watchdog fires, as the profile has it);
2. decide, with the real engine, then the guardrails on the simulated fleet; while the decision is
   `diagnose`, run that DCGM level (its duration drawn from DCGM's range), add its result and decide
   again. Level 1 runs with the node in service and the job waits on it; from level 2 the job moves
   to a spare node first;
3. act: a reset, reboot or replacement takes the node out for its duration (a replacement first
   waits for a person's approval when the policy asks for one); an escalation or a drain waits for
   a person, who then fixes what is really wrong;
4. the job restarts from its last checkpoint: on the same nodes when the node stayed
   (`restart_in_place_s`; a hung job requeued onto them, `restart_hung_s`), else on a spare (`restart_s`, after waiting for a node to come back when
   there is none). A switch fault cuts off every node under the switch: the job needs that many
   spares, or waits for the network's repair.

A fault the action did not clear strikes the node again later; after `repeats_before_human`
repeats a person takes the node out and fixes it. Training between faults saves a checkpoint
every interval; a fault loses the work since the last completed save.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

from medic.facts import HISTORY_WINDOW
from medic.policy import Action, Decision, LoadedPolicy, guardrails
from medic.policy.guardrails import FleetState
from medic.policy.model import DESTRUCTIVE, OUT_OF_SERVICE
from medic.whatif.fleetsim.decisions import Decider, Diagnostic, Shape
from medic.whatif.fleetsim.failures import CLEARS, Cause, Nature, Signature, arrivals, draw
from medic.whatif.fleetsim.params import SimParams
from medic.whatif.fleetsim.report import BADPUT, Report

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
EPISODE_WINDOW = 86_400.0  # earlier episodes that count rules look back on (the default policy's 24 h)
MAX_LADDER = 4
V = TypeVar("V")


@dataclass(order=True, slots=True)
class _Fault:
    at: float
    serial: int
    node: int = field(compare=False)
    cause: Cause = field(compare=False)
    signature: Signature = field(compare=False)
    nature: Nature = field(compare=False)
    repeats: int = field(compare=False, default=0)


@dataclass(slots=True)
class _Spares:
    """Idle nodes the job can restart on, and when the nodes being repaired come back."""

    free: int
    returning: list[float] = field(default_factory=list)

    def give_back(self, at: float) -> None:
        heapq.heappush(self.returning, at)

    def take(self, at: float) -> float:
        """When the job has a node to replace the one it lost, asking at `at`."""
        while self.returning and self.returning[0] <= at:
            heapq.heappop(self.returning)
            self.free += 1
        if self.free:
            self.free -= 1
            return at
        return heapq.heappop(self.returning)  # the first node back goes straight to the job


@dataclass(slots=True)
class _Expiring(Generic[V]):
    """A mapping whose entries leave at their own time, so what the guardrails scan stays small."""

    items: dict[str, V] = field(default_factory=dict)
    _until: dict[str, float] = field(default_factory=dict)
    _heap: list[tuple[float, str]] = field(default_factory=list)

    def put(self, key: str, value: V, until: float) -> None:
        self.items[key], self._until[key] = value, until
        heapq.heappush(self._heap, (until, key))

    def expire(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            until, key = heapq.heappop(self._heap)
            if self._until.get(key) == until:
                del self.items[key], self._until[key]


@dataclass(slots=True)
class _Node:
    remediations: list[float] = field(default_factory=list)  # our node actions (recorded as history)
    episodes: list[float] = field(default_factory=list)  # fault episodes


class Simulation:
    def __init__(self, params: SimParams, loaded: LoadedPolicy, seed: int) -> None:
        self.params, self.loaded, self.seed = params, loaded, seed
        self.rng = random.Random(seed)
        self.decider = Decider(loaded, params.nodes_per_switch)
        self.tau, self.delta = params.interval_s, params.checkpoint_save_s
        self.spares = _Spares(params.spare_nodes)
        self.queue: list[_Fault] = []
        self.serial = 0
        self.nodes: dict[int, _Node] = {}
        # The fleet as the guardrails see it.
        self.out: _Expiring[float] = _Expiring()  # node -> when it comes back
        self.destructive_at: list[datetime] = []
        self.last_destructive: dict[str, datetime] = {}
        self.taken_out_at: _Expiring[datetime] = _Expiring()  # within the circuit breaker's window
        breaker = loaded.policy.guardrails.circuit_breaker
        self.breaker_window_s = 60.0 * breaker.window_minutes if breaker else 0.0
        # The job.
        self.down_until = 0.0
        self.goodput_s = 0.0
        self.badput = dict.fromkeys(BADPUT, 0.0)
        self.timeline: list[tuple[float, float]] = []
        self.counts: dict[str, Counter[str]] = {k: Counter() for k in ("cause", "action", "rule")}
        self.faults = self.repeats = self.humans = self.approvals = 0
        self.replaced = self.false_replacements = 0

    def run(self) -> Report:
        p = self.params
        rate = p.gpus / (p.gpu_mtbf_hours * 3600)
        for at in arrivals(rate, p.horizon_s, self.rng):
            cause, signature, nature = draw(self.rng)
            self._push(at, self.rng.randrange(p.nodes), cause, signature, nature, 0)
        while self.queue:
            fault = heapq.heappop(self.queue)
            if fault.at >= p.horizon_s:
                break
            self._incident(fault)
        if self.down_until < p.horizon_s:
            self._train(self.down_until, p.horizon_s, interrupted=False)
        self.timeline.append((p.horizon_s / 3600, self.goodput_s / p.horizon_s))
        return self._report()

    def _push(self, at: float, node: int, cause: Cause, sig: Signature, nature: Nature, repeats: int) -> None:
        self.serial += 1
        heapq.heappush(self.queue, _Fault(at, self.serial, node, cause, sig, nature, repeats))

    # --- the job's time ------------------------------------------------------------------

    def _train(self, start: float, end: float, *, interrupted: bool) -> None:
        """Account a stretch of training: a save every interval, and the unsaved tail lost if interrupted."""
        cycle = self.tau + self.delta
        done, rest = divmod(end - start, cycle)
        self.goodput_s += done * self.tau
        self.badput["checkpoint"] += done * self.delta + max(0.0, rest - self.tau)
        if interrupted:
            self.badput["lost_work"] += min(rest, self.tau)
        else:
            self.goodput_s += min(rest, self.tau)

    def _down(self, start: float, segments: list[tuple[str, float]]) -> None:
        """The job is down from `start` through these stretches; only time not already down counts."""
        cursor = start
        for bucket, seconds in segments:
            low, high = max(cursor, self.down_until), min(cursor + seconds, self.params.horizon_s)
            if high > low:
                self.badput[bucket] += high - low
            cursor += seconds
        self.down_until = max(self.down_until, cursor)

    # --- one incident ----------------------------------------------------------------------

    def _incident(self, fault: _Fault) -> None:
        p, t = self.params, fault.at
        if fault.repeats:
            self.repeats += 1
        else:
            self.faults += 1
        self.counts["cause"][fault.cause.name] += 1
        if t >= self.down_until:
            self._train(self.down_until, t, interrupted=True)
            self.timeline.append((t / 3600, self.goodput_s / t))
        name = f"gpu-node-{fault.node}"
        history = self.nodes.setdefault(fault.node, _Node())
        detection = {
            "kernel": p.detect_kernel_s,
            "health": p.detect_health_s,
            "crash": p.detect_crash_s,
            "hang": p.detect_hang_s,
        }[fault.signature.detect]
        now = t + detection
        decision, now, moved_at, waited = self._ladder(fault, name, history, now)
        self.counts["action"][decision.action.value] += 1
        self.counts["rule"][decision.rule] += 1
        history.episodes.append(t)

        action, nature = decision.action, fault.nature
        cleared = _clears(action, nature)
        false_replacement = action is Action.REPLACE and nature in (Nature.RESTART, Nature.NETWORK)
        fixed_by_human = action in (Action.ESCALATE, Action.DRAIN) or (
            fault.repeats >= p.repeats_before_human and not cleared
        )
        segments: list[tuple[str, float]] = [("detection", detection), ("diagnosis", waited)]
        node_back: float | None = None  # when the node rejoins the spares, if it left the job
        held = 1  # nodes the job must do without
        if action in OUT_OF_SERVICE:
            history.remediations.append(now)  # recorded as the node's history, as the flows do
        if fixed_by_human:
            self.humans += 1
            node_back = now + p.human_response_s + self._fix_s(nature)
            cleared = True
            self.replaced += nature is Nature.REPLACE
            if nature is Nature.NETWORK:
                held = p.nodes_per_switch  # every node under the switch is cut off until the repair
        elif action in DESTRUCTIVE:
            approval = p.human_response_s if decision.approve else 0.0
            self.approvals += decision.approve
            node_back = now + approval + self._action_s(action) + self._level_s(1)
            self._record_destructive(name, now)
            if action is Action.REPLACE:
                self.replaced += 1
                self.false_replacements += false_replacement
        elif moved_at is not None:  # drained for a level 2+ diagnostic: back once verified
            node_back = now + self._level_s(1)
        if node_back is not None:
            out_at = now if moved_at is None else moved_at
            self.taken_out_at.put(name, self._time(out_at), out_at + self.breaker_window_s)
            self.out.put(name, node_back, node_back)
            job_at = t + detection + waited  # when the job is free to restart elsewhere
            for _ in range(held):
                self.spares.give_back(node_back)
            spare_at = max(self.spares.take(job_at) for _ in range(held))
            segments.append(("false_replacement" if false_replacement else "recovery", spare_at - job_at))
        # A node still in service keeps the job where it is: torchrun restarts it in place, no requeue;
        # a hung job is requeued onto the nodes it has.
        hung = fault.signature.detect == "hang"
        in_place = p.hung_restart_s if hung else p.in_place_restart_s
        segments.append(("recovery", in_place if node_back is None else p.restart_s))
        self._down(t, segments)
        if not cleared:
            back = node_back if node_back is not None else self.down_until
            again = back + self.rng.expovariate(1 / (p.recurrence_hours * 3600))
            self._push(again, fault.node, fault.cause, fault.signature, nature, fault.repeats + 1)

    def _ladder(
        self, fault: _Fault, name: str, history: _Node, now: float
    ) -> tuple[Decision, float, float | None, float]:
        """Decide, climbing DCGM levels while the policy asks: the final decision, when it was
        taken, when the job moved off the node (None: it never did) and how long the job waited
        on diagnostics."""
        recent = sum(1 for at in history.remediations if now - at <= HISTORY_WINDOW.total_seconds())
        episodes = sum(1 for at in history.episodes if fault.at - at <= EPISODE_WINDOW)
        diagnostics: tuple[Diagnostic, ...] = ()
        moved_at: float | None = None
        waited = 0.0
        for _ in range(MAX_LADDER + 1):
            shape = Shape(fault.signature, moved_at is not None, recent, episodes, diagnostics)
            decision, scope = self.decider.decide(shape)
            decision = guardrails.apply(
                self.loaded.policy.guardrails, self._fleet(now), name, decision, scope
            )
            if decision.action is not Action.DIAGNOSE or decision.diagnose_level is None:
                return decision, now, moved_at, waited
            level = decision.diagnose_level
            seconds = self._level_s(level)
            if level >= 2 and moved_at is None:
                moved_at = now  # the job restarts elsewhere while the node is tested
            elif moved_at is None:
                waited += seconds
            now += seconds
            diagnostics += (self._result(fault, level),)
        raise AssertionError("the ladder climbs at most four levels")

    # --- the fleet ---------------------------------------------------------------------------

    def _fleet(self, now: float) -> FleetState:
        self.out.expire(now)
        self.taken_out_at.expire(now)
        at = self._time(now)
        self.destructive_at = [d for d in self.destructive_at if at - d <= timedelta(hours=1)]
        return FleetState(
            now=at,
            fleet_size=self.params.nodes + self.params.spare_nodes,
            out_of_service=frozenset(self.out.items),
            destructive_at=tuple(self.destructive_at),
            last_destructive=self.last_destructive,
            taken_out_at=self.taken_out_at.items,
        )

    def _record_destructive(self, name: str, now: float) -> None:
        at = self._time(now)
        self.destructive_at.append(at)
        self.last_destructive[name] = at

    # --- durations and outcomes --------------------------------------------------------------

    def _level_s(self, level: int) -> float:
        return self.rng.uniform(*self.params.dcgm_level_s[level])

    def _result(self, fault: _Fault, level: int) -> Diagnostic:
        found = fault.signature.fails_from
        if found is not None and fault.nature is not Nature.RESTART and level >= found[0]:
            return level, "fail", found[1]
        return level, "pass", ""

    def _action_s(self, action: Action) -> float:
        p = self.params
        return {Action.RESET_GPU: p.reset_gpu_s, Action.REBOOT: p.reboot_s, Action.REPLACE: p.replace_s}[
            action
        ]

    def _fix_s(self, nature: Nature) -> float:
        p = self.params
        return {
            Nature.RESTART: 0.0,
            Nature.RESET: p.reset_gpu_s,
            Nature.REBOOT: p.reboot_s,
            Nature.REPLACE: p.replace_s,
            Nature.NETWORK: p.network_repair_s,
        }[nature]

    @staticmethod
    def _time(seconds: float) -> datetime:
        return EPOCH + timedelta(seconds=seconds)

    def _report(self) -> Report:
        p = self.params
        return Report(
            policy=str(self.loaded.path),
            policy_sha256=self.loaded.sha256,
            seed=self.seed,
            params={
                **asdict(p),
                "dcgm_level_s": {str(level): list(span) for level, span in p.dcgm_level_s.items()},
            },
            checkpoint_interval_s=self.tau,
            wall_s=p.horizon_s,
            goodput_s=self.goodput_s,
            badput_s=dict(self.badput),
            interruptions=self.faults + self.repeats,
            faults=self.faults,
            repeats=self.repeats,
            by_cause=dict(self.counts["cause"]),
            actions=dict(self.counts["action"]),
            rules=dict(self.counts["rule"]),
            human_interventions=self.humans,
            approvals=self.approvals,
            nodes_replaced=self.replaced,
            false_replacements=self.false_replacements,
            timeline=tuple(self.timeline),
            decided=self.decider.decided,
            asked=self.decider.asked,
        )


def _clears(action: Action, nature: Nature) -> bool:
    """Whether the action (and the job's restart after it) clears the fault."""
    return nature is Nature.RESTART or nature in CLEARS.get(action, frozenset())


def simulate(params: SimParams, loaded: LoadedPolicy, seed: int) -> Report:
    """One run; the same params, policy and seed give the same report."""
    return Simulation(params, loaded, seed).run()


def mtbf_by_size(
    params: SimParams, loaded: LoadedPolicy, seed: int, sizes: tuple[int, ...]
) -> list[tuple[int, float]]:
    """(GPUs, observed seconds between interruptions) of the same fleet at each size."""
    return [(gpus, simulate(replace(params, gpus=gpus), loaded, seed).observed_mtbf_s) for gpus in sizes]
