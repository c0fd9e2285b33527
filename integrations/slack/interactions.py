"""Slack's interactive callbacks (a click on Approve / Reject) turned into flow-run answers.

Slack POSTs `application/x-www-form-urlencoded` with one field, `payload`, holding JSON; the
request must be verified (signature.py) before anything here runs, and answered within 3 s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import parse_qs

from integrations.slack.blocks import APPROVE_ACTION, REJECT_ACTION
from medic.errors import PermanentError


class InteractionError(PermanentError, ValueError):
    """Raised when a Slack interaction payload is not an approval click GPU Medic sent."""


@dataclass(frozen=True, slots=True)
class ApprovalClick:
    flow_run: str
    incident: str
    approved: bool
    user_id: str
    user_name: str


def parse_click(body: bytes) -> ApprovalClick | None:
    """The approval click in a callback body; None for other interactions (e.g. a link button)."""
    fields = parse_qs(body.decode("utf-8", "replace"))
    if "payload" not in fields:
        raise InteractionError("no `payload` field: not a Slack interaction")
    try:
        payload = json.loads(fields["payload"][0])
    except json.JSONDecodeError as error:
        raise InteractionError(f"payload is not JSON: {error.msg}") from None
    for action in payload.get("actions") or []:
        if action.get("action_id") not in (APPROVE_ACTION, REJECT_ACTION):
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
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise InteractionError(f"malformed approval action: {error}") from None
    return None


def is_approver(click: ApprovalClick, approvers: list[str]) -> bool:
    """Approvers are listed by Slack user id or user name; an empty list lets nobody approve."""
    return click.user_id in approvers or click.user_name in approvers
