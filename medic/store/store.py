"""The store: every event, rejection, decision, diagnostic, action and stage, on any SQLAlchemy URL,
with a tamper-evident chain over the audited rows (medic/store/ledger.py).

`Store` is the sum of one mixin per concern, each in its own module of medic/store/; they share
only the engine and its sessions (medic/store/engine.py).
"""

from __future__ import annotations

from medic.store.actions import ActionsMixin
from medic.store.ageing import AgeingMixin
from medic.store.approvals import ApprovalsMixin
from medic.store.breaker import BreakerMixin
from medic.store.events import EventsMixin
from medic.store.goodput import GoodputMixin
from medic.store.incidents import IncidentsMixin
from medic.store.metrics import MetricsMixin
from medic.store.modes import ModesMixin
from medic.store.outbox import OutboxMixin
from medic.store.prune import PruneMixin
from medic.store.rejections import RejectionsMixin
from medic.store.replay import ReplayMixin
from medic.store.report import ReportMixin
from medic.store.rollout import RolloutMixin
from medic.store.stages import StagesMixin


class Store(
    ReportMixin,
    RolloutMixin,
    ReplayMixin,  # before EventsMixin, which it builds on
    EventsMixin,
    RejectionsMixin,
    IncidentsMixin,
    StagesMixin,
    OutboxMixin,
    ActionsMixin,
    ApprovalsMixin,
    BreakerMixin,
    ModesMixin,
    GoodputMixin,
    MetricsMixin,
    AgeingMixin,
    PruneMixin,  # and VerifyMixin, which it builds on: the audit chain
):
    pass
