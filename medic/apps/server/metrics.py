"""Prometheus metrics for one ingest app: its own registry, so two apps never share counters."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from medic.policy import Policy, PolicyError
from medic.rollout import RolloutReport
from medic.store import Store, utcnow
from medic.store.rollout import SINCE
from medic.tasks.runtime.process import PolicyStatus, configured


class StoreCollector(Collector):
    """Figures read from the store at scrape time: they stay right across restarts and replicas."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def describe(self) -> Iterator[Metric]:
        # Named here so registering costs no query.
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        up, incidents, actions, rejected, kept, held_for, breaker, blocks, waiting, oldest = self._families()
        try:
            holds = self.store.held_nodes()
            waits = self.store.approval_waits()
            tripped = self.store.open_breaker_record()
            blocked = self.store.guardrail_blocks()
            contained = self.store.contain_delays()
            open_incidents = self.store.open_incident_count()
            action_counts = self.store.action_counts()
            delays = self.store.decision_delays()
            dead_letter = self.store.rejection_counts()
        except Exception:  # a scrape while the database is down must still show the ingest counters
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        incidents.add_metric([], open_incidents)
        for (action, status), count in sorted(action_counts.items()):
            actions.add_metric([action, status], count)
        # Summed over sources: a source is a client address, too many to be a label.
        by_class: dict[str, tuple[int, int]] = {}
        for row in dead_letter:
            seen, held = by_class.get(row.reason_class, (0, 0))
            by_class[row.reason_class] = (seen + row.rejected, held + row.kept)
        for reason_class, (seen, held) in sorted(by_class.items()):
            rejected.add_metric([reason_class], seen)
            kept.add_metric([reason_class], held)
        now = utcnow()
        for hold in holds:
            since = (now - hold.since).total_seconds()
            held_for.add_metric(
                [hold.node, hold.incident, hold.action, hold.incident_status or "unknown"], since
            )
        breaker.add_metric([], 0 if tripped is None else 1)
        for guardrail, count in sorted(blocked.items()):
            blocks.add_metric([guardrail], count)
        waiting.add_metric([], len(waits))
        oldest.add_metric([], max(waits, default=0.0))
        yield from (up, incidents, actions, rejected, kept, held_for, breaker, blocks, waiting, oldest)
        yield _histogram(
            "medic_decision_seconds",
            "Per incident, from its first event's arrival to its first policy decision (from the store).",
            delays,
        )
        yield _histogram(
            "medic_contain_seconds",
            "Per contained incident, from its first event's arrival to its node drained by the containment "
            "(from the store).",
            contained,
        )

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily,
        GaugeMetricFamily,
        CounterMetricFamily,
        CounterMetricFamily,
        CounterMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        CounterMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
    ]:
        return (
            GaugeMetricFamily("medic_store_up", "1 if the store answered this scrape, else 0."),
            GaugeMetricFamily("medic_incidents_open", "Incidents not closed yet."),
            CounterMetricFamily(
                "medic_actions", "Node actions recorded in the store.", labels=["action", "status"]
            ),
            CounterMetricFamily(
                "medic_dead_letter_rejected",
                "Rejected input by reason class, every replica and restart (the store's counts).",
                labels=["reason_class"],
            ),
            CounterMetricFamily(
                "medic_dead_letter_kept",
                "Rejected input kept verbatim in the dead letter, by reason class (the rest is counted).",
                labels=["reason_class"],
            ),
            GaugeMetricFamily(
                "medic_node_held_seconds",
                "Per node GPU Medic holds out of service (its action took it out, no resume of ours since): "
                "seconds since, by the incident that holds it and that incident's status.",
                labels=["node", "incident", "action", "incident_status"],
            ),
            GaugeMetricFamily(
                "medic_breaker_open",
                "1 while the circuit breaker is open (no node is touched until a human closes it), else 0.",
            ),
            CounterMetricFamily(
                "medic_guardrail_blocks",
                "Incidents a guardrail stopped an action of, by guardrail (their decisions name it).",
                labels=["guardrail"],
            ),
            GaugeMetricFamily(
                "medic_approvals_waiting", "Incidents waiting on a human's approval (an unanswered request)."
            ),
            GaugeMetricFamily(
                "medic_approval_oldest_wait_seconds",
                "Seconds the oldest unanswered approval request has waited; 0 when none waits.",
            ),
        )


# From sub-second (the warm path) to the half hour a DCGM level 3 may take before a decision.
DECISION_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


def _histogram(name: str, documentation: str, delays: list[float]) -> HistogramMetricFamily:
    buckets = [(str(bound), sum(1 for d in delays if d <= bound)) for bound in DECISION_BUCKETS]
    buckets.append(("+Inf", len(delays)))
    family = HistogramMetricFamily(name, documentation)
    family.add_metric([], buckets, sum(delays))
    return family


def _policy_in_force() -> PolicyStatus | None:
    rt = configured()
    return rt.policy_status() if rt is not None else None


class PolicyCollector(Collector):
    """Whether the policy file loaded at its last read, and which policy is in force.

    Read at scrape time, as an incident would read it, so a broken edit shows (and can alert)
    before the next fault does. An app with no runtime (no remediation here) shows nothing.
    """

    def __init__(self, status: Callable[[], PolicyStatus | None] = _policy_in_force) -> None:
        self.status = status

    def describe(self) -> Iterator[Metric]:
        yield from self._families()  # named here, so registering reads no file

    def collect(self) -> Iterator[Metric]:
        status = self.status()
        if status is None:
            return
        ok, info, since = self._families()
        ok.add_metric([], 1 if status.last_load_ok else 0)
        yield ok
        if status.sha256 is None:
            return  # nothing in force: no incident can be decided
        info.add_metric([], {"sha256": status.sha256, "path": status.path})
        yield info
        if status.in_force_since is not None:
            since.add_metric([], status.in_force_since.timestamp())
            yield since

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, InfoMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "medic_policy_last_load_ok",
                "1 if the policy file loaded at its last read; 0 if it was refused (the last good "
                "policy stays in force, see medic_policy_info).",
            ),
            InfoMetricFamily("medic_policy", "The policy in force: its file and the SHA-256 of its bytes."),
            GaugeMetricFamily(
                "medic_policy_loaded_timestamp_seconds",
                "When the policy in force was first loaded (Unix time).",
            ),
        )


def _policy_now() -> Policy | None:
    """The policy in force, as an incident would read it; None with no runtime or none ever loaded."""
    rt = configured()
    if rt is None:
        return None
    try:
        return rt.policy().policy
    except PolicyError:  # none in force: PolicyCollector says so
        return None


VERDICTS = ("agreed", "disagreed", "missed_by_people", "false_alarm", "pending")
# The report moves by hours (a 6 h window, 7 days' recurrence) and costs a 30-day read of the store:
# scrapes within a minute of each other, from several Prometheus servers, share one build.
ROLLOUT_REFRESH_S = 60.0


class RolloutCollector(Collector):
    """Each node group's rollout record (docs/rollout.md#on-metrics): `medic rollout report` over its
    default span (the last 30 days), from the store at scrape time, judged against the policy in force.
    Without a policy in force there is no bar to judge against, and nothing is shown."""

    def __init__(self, store: Store, policy: Callable[[], Policy | None] = _policy_now) -> None:
        self.store = store
        self.policy = policy
        self._last: tuple[float, Policy, RolloutReport] | None = None  # built at, for what bar, what

    def describe(self) -> Iterator[Metric]:
        yield from self._families()  # named here, so registering reads nothing

    def collect(self) -> Iterator[Metric]:
        policy = self.policy()
        if policy is None:
            return
        built = self._report(policy)
        if built is not None:
            yield from self._filled(built)

    def _report(self, policy: Policy) -> RolloutReport | None:
        """The report, built again when the last is a minute old or the bar has changed."""
        last, at = self._last, time.monotonic()
        if last is not None and at - last[0] < ROLLOUT_REFRESH_S and last[1] == policy:
            return last[2]
        now = utcnow()
        try:
            built = self.store.rollout_report(policy, since=now - SINCE, now=now)
        except Exception:  # the store's trouble: medic_store_up says it
            return None
        self._last = (at, policy, built)
        return built

    def _filled(self, built: RolloutReport) -> Iterator[Metric]:
        verdicts, misses, destructive, agreement, ready, saved = self._families()
        for g in built.groups:
            for verdict in VERDICTS:
                verdicts.add_metric([g.name, verdict], getattr(g, verdict))
            misses.add_metric([g.name], g.our_misses)
            destructive.add_metric([g.name], g.destructive_disagreements)
            if g.readiness.agreement is not None:
                agreement.add_metric([g.name], g.readiness.agreement)
            ready.add_metric([g.name], 1 if g.readiness.ready else 0)
            saved.add_metric([g.name], g.saved_minutes_total)
        yield from (verdicts, misses, destructive, agreement, ready, saved)

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
    ]:
        group = ["group"]
        return (
            GaugeMetricFamily(
                "medic_rollout_decisions",
                "Would-have decisions (observe mode, a node action) of the last 30 days, by node group and "
                "verdict beside what people did: agreed, disagreed, missed_by_people, false_alarm, pending.",
                labels=["group", "verdict"],
            ),
            GaugeMetricFamily(
                "medic_rollout_our_misses",
                "People's actions of the last 30 days on a group's nodes with no decision of GPU Medic before.",
                labels=group,
            ),
            GaugeMetricFamily(
                "medic_rollout_destructive_disagreements",
                "Would-have reset_gpu, reboot or replace decisions of the last 30 days disagreed or a false "
                "alarm, by node group.",
                labels=group,
            ),
            GaugeMetricFamily(
                "medic_rollout_agreement_ratio",
                "Share of a group's judged would-have decisions of the last 30 days people or the node bore "
                "out; absent while none is judged.",
                labels=group,
            ),
            GaugeMetricFamily(
                "medic_rollout_ready",
                "1 if the group clears the policy's readiness thresholds over the last 30 days, else 0.",
                labels=group,
            ),
            GaugeMetricFamily(
                "medic_rollout_saved_minutes",
                "Minutes GPU Medic would have saved over a group's agreed decisions of the last 30 days "
                "(people's action time minus its decision's).",
                labels=group,
            ),
        )


class IngestMetrics:
    def __init__(
        self, store: Store, policy_status: Callable[[], PolicyStatus | None] = _policy_in_force
    ) -> None:
        self.registry = CollectorRegistry()
        self.received = Counter(
            "medic_events_received", "Items posted to an ingest route (valid or not).", registry=self.registry
        )
        self.stored = Counter(
            "medic_events_stored", "Posted events stored for the first time.", registry=self.registry
        )
        self.duplicates = Counter(
            "medic_events_duplicate", "Posted events whose id was already stored.", registry=self.registry
        )
        self.rejected = Counter(
            "medic_events_rejected", "Posted items that were not valid events.", registry=self.registry
        )
        self.sentry_ignored = Counter(
            "medic_sentry_ignored",
            "Sentry webhooks acknowledged (202) and dropped: no_error_event (a resource without one), "
            "not_a_fault (an exception of no fault kind).",
            labelnames=["reason"],
            registry=self.registry,
        )
        self.alertmanager_ignored = Counter(
            "medic_alertmanager_ignored",
            "Alerts posted to /v1/alertmanager and not acted on: resolved (recorded, nothing undone).",
            labelnames=["reason"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "medic_ingest_seconds",
            "Time to answer POST /v1/events, /v1/sentry or /v1/alertmanager, by HTTP status.",
            labelnames=["code"],
            registry=self.registry,
        )
        self.registry.register(StoreCollector(store))
        self.registry.register(PolicyCollector(policy_status))
        self.registry.register(RolloutCollector(store))
