"""A suspected rank's own profile, carried to the straggler named about it (docs/culprit.md).

A rank's hooks take a short torch.profiler trace when its own work slows against its recent past,
or when asked to (a request file), and report it: a `health_check` with `check: profile` and the
trace's path as `artifact`. Like step timings it is telemetry and opens no incident. The latest
one of each rank is kept here, and a `straggler` about that rank up to `LOOKBACK` later carries it
(`profile_event`, `artifact`): the trace reaches the incident's evidence with the culprit, as a hung
rank's stack dump does (medic/hangs.py). Pure: events in, events out.
"""

from __future__ import annotations

from datetime import timedelta

from medic.events import EventKind, FaultEvent

PROFILE_CHECK = "profile"
# As long as the hooks wait between two profiles of one slowdown: an older one shows another time.
LOOKBACK = timedelta(minutes=30)


def is_profile(event: FaultEvent) -> bool:
    return event.kind is EventKind.HEALTH_CHECK and event.attributes.get("check") == PROFILE_CHECK


class Profiles:
    def __init__(self) -> None:
        self.latest: dict[tuple[str, int], FaultEvent] = {}

    def keep(self, event: FaultEvent) -> None:
        """Hold a profile report for its rank's stragglers (one without a rank or a path is no use)."""
        if event.job is None or event.rank is None or not isinstance(event.attributes.get("artifact"), str):
            return
        self.latest[event.job, event.rank] = event
        # Bounded: profiles are rare, and one too old to attach to anything is dropped here.
        for key in [k for k, kept in self.latest.items() if event.time - kept.time > LOOKBACK]:
            del self.latest[key]

    def attach(self, event: FaultEvent) -> FaultEvent:
        """A straggler with its rank's latest profile, where one came no more than LOOKBACK before."""
        if event.kind is not EventKind.STRAGGLER or event.job is None or event.rank is None:
            return event
        profile = self.latest.get((event.job, event.rank))
        if profile is None or "artifact" in event.attributes or event.time - profile.time > LOOKBACK:
            return event
        attributes = event.attributes | {
            "profile_event": profile.id,
            "artifact": profile.attributes["artifact"],
        }
        return event.model_copy(update={"attributes": attributes})
