"""Slack's interactive callbacks (a click on Approve / Reject) turned into flow-run answers.

Slack POSTs `application/x-www-form-urlencoded` with one field, `payload`, holding JSON; the
request must be verified (signature.py) before anything here runs, and answered within 3 s.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from urllib.parse import parse_qs

from medic.errors import PermanentError
from medic.integrations.slack.blocks import APPROVE_ACTION, REJECT_ACTION


class InteractionError(PermanentError, ValueError):
    """Raised when a Slack interaction payload is not an approval click GPU Medic sent."""


@dataclass(frozen=True, slots=True)
class ApprovalClick:
    flow_run: str
    incident: str
    approved: bool
    user_id: str
    user_name: str  # shown in replies only; never trusted


def parse_click(body: bytes) -> ApprovalClick | None:
    """The approval click in a callback body; None for other interactions (e.g. a link button)."""
    fields = parse_qs(body.decode("utf-8", "replace"))
    if "payload" not in fields:
        raise InteractionError("no `payload` field: not a Slack interaction")
    try:
        payload = json.loads(fields["payload"][0])
    except (ValueError, RecursionError) as error:  # a 5,000-digit number, or nesting past the limit
        raise InteractionError(f"payload is not JSON: {getattr(error, 'msg', error)}") from None
    if not isinstance(payload, dict):
        raise InteractionError(f"payload is not a JSON object: {type(payload).__name__}")
    actions = payload.get("actions")
    for action in actions if isinstance(actions, list) else []:
        if not isinstance(action, dict) or action.get("action_id") not in (APPROVE_ACTION, REJECT_ACTION):
            continue
        try:
            value = json.loads(action["value"])
            user = payload["user"]
            return ApprovalClick(
                flow_run=str(value["flow_run"]),
                incident=str(value["incident"]),
                approved=action["action_id"] == APPROVE_ACTION,
                user_id=str(user["id"]),
                user_name=str(user.get("username") or user.get("name") or user["id"]),
            )
        except (KeyError, TypeError, ValueError, RecursionError) as error:
            raise InteractionError(f"malformed approval action: {error}") from None
    return None


def is_approver(click: ApprovalClick, approver_ids: Collection[str]) -> bool:
    """Only the clicking user's id counts: a display name can be taken by anyone in the workspace.
    An empty collection lets nobody approve."""
    return click.user_id in approver_ids
