"""Prometheus metrics for one ingest app: its own registry, so two apps never share counters."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from medic.store import Store


class StoreCollector(Collector):
    """Figures read from the store at scrape time: they stay right across restarts and replicas."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def describe(self) -> Iterator[Metric]:
        # Named here so registering costs no query.
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        up, incidents, actions = self._families()
        try:
            open_incidents = self.store.open_incident_count()
            action_counts = self.store.action_counts()
            delays = self.store.decision_delays()
        except Exception:  # a scrape while the database is down must still show the ingest counters
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        incidents.add_metric([], open_incidents)
        for (action, status), count in sorted(action_counts.items()):
            actions.add_metric([action, status], count)
        yield from (up, incidents, actions, _decision_histogram(delays))

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily]:
        return (
            GaugeMetricFamily("medic_store_up", "1 if the store answered this scrape, else 0."),
            GaugeMetricFamily("medic_incidents_open", "Incidents not closed yet."),
            CounterMetricFamily(
                "medic_actions", "Node actions recorded in the store.", labels=["action", "status"]
            ),
        )


# From sub-second (the warm path) to the half hour a DCGM level 3 may take before a decision.
DECISION_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


def _decision_histogram(delays: list[float]) -> HistogramMetricFamily:
    buckets = [(str(bound), sum(1 for d in delays if d <= bound)) for bound in DECISION_BUCKETS]
    buckets.append(("+Inf", len(delays)))
    family = HistogramMetricFamily(
        "medic_decision_seconds",
        "Per incident, from its first event's arrival to its first policy decision (from the store).",
    )
    family.add_metric([], buckets, sum(delays))
    return family


class IngestMetrics:
    def __init__(self, store: Store) -> None:
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
        self.latency = Histogram(
            "medic_ingest_seconds",
            "Time to answer POST /v1/events or /v1/sentry, by HTTP status.",
            labelnames=["code"],
            registry=self.registry,
        )
        self.registry.register(StoreCollector(store))
