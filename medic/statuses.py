"""The statuses an incident, a node action, a stage, the act stage's outcome and a chat message go
through.

StrEnums: a member is equal to its string, so the store's text columns, the JSON lines and the
Prefect events carry the same bytes as the plain strings they replace. Rows read back from the
store hold plain strings; compare them with members, never by identity (`is`).
"""

from __future__ import annotations

from enum import StrEnum


class IncidentStatus(StrEnum):
    OPEN = "open"
    REMEDIATING = "remediating"
    WAITING_FOR_APPROVAL = "waiting for approval"
    CLOSED = "closed"  # dealt with: no action was needed, or it was done and the node verified
    ESCALATED = "escalated"  # handed to humans: by the policy, or the action failed or did not hold
    # The flow run raised: the incident is neither active nor handled, and replayed input
    # runs it again.
    FAILED = "failed"


# Still being handled: more of the same fault joins the incident rather than opening another.
ACTIVE_INCIDENT_STATUSES = frozenset(
    {IncidentStatus.OPEN, IncidentStatus.REMEDIATING, IncidentStatus.WAITING_FOR_APPROVAL}
)
# Handled: a second start for the incident does nothing twice.
TERMINAL_INCIDENT_STATUSES = frozenset({IncidentStatus.CLOSED, IncidentStatus.ESCALATED})


class ActionStatus(StrEnum):
    """A node action in the store: the intent is written before the call, the outcome after."""

    INTENT = "intent"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # the call raised: the claim may be taken back to try again


# The call reported back; an intent without one means a process died in between.
TERMINAL_ACTION_STATUSES = frozenset({ActionStatus.SUCCEEDED, ActionStatus.FAILED})


class StepStatus(StrEnum):
    """How a stage ended. A step row is written when its stage ends: every status is final."""

    OK = "ok"
    SKIPPED = "skipped"
    FAILED = "failed"


class ActStatus(StrEnum):
    """What the act stage did about the decided action (the flow's `act` in its outcome)."""

    DONE = "done"
    ALREADY_DONE = "already-done"  # this fault's action succeeded in an earlier run
    SKIPPED = "skipped"
    ESCALATED = "escalated"
    OBSERVED = "observed"  # the node's group is in observe mode: decided, told, nothing done (decision 0017)


# The node action happened, in this run or an earlier one for the same fault.
ACT_DONE_STATUSES = frozenset({ActStatus.DONE, ActStatus.ALREADY_DONE})


class MessageStatus(StrEnum):
    """A chat message in the store's outbox (medic/tasks/notify.py): pending until it is settled."""

    PENDING = "pending"
    DELIVERED = "delivered"
    GIVEN_UP = "given up"  # refused, too old, or its run's final flush ended: a failed step says why
