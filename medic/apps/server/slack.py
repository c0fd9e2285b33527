"""`POST /v1/slack/interactions`: an Approve / Reject click resumes the paused flow run.

The signature is checked first (SLACK_SIGNING_SECRET), then that the clicking user's Slack id is
one of the policy's approvers (by id alone: anyone can take a display name); the answer then
goes to the run as typed input, exactly as the Prefect UI's resume form would send it. Slack
wants an answer within 3 s, so only that work happens here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from uuid import UUID

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from medic.integrations.slack.interactions import InteractionError, is_approver, parse_click
from medic.integrations.slack.signature import SignatureError, check_headers, verify
from medic.store.tables import ApprovalRecord


@dataclass(frozen=True, slots=True)
class SlackCallbacks:
    # The Slack user ids allowed to answer, read at each click so a policy edit applies at once
    # (Runtime.approvers: emails in the policy already resolved to ids, once per approver list).
    approvers: Callable[[], Collection[str]]
    resume: Callable[[UUID, dict[str, object]], None]  # prefect.flow_runs.resume_flow_run
    # Store.claim_answer for (incident, approved, by): the first answer wins, atomically.
    claim: Callable[[str, bool, str], tuple[ApprovalRecord | None, bool]]
    reopen: Callable[[int], None]  # Store.reopen_approval: the answer could not reach the run


def _reply(text: str, status: int = 200) -> Response:
    # Slack shows `text` to the clicking user when the response is ephemeral.
    return JSONResponse(
        {"response_type": "ephemeral", "replace_original": False, "text": text}, status_code=status
    )


def refuse_early(request: Request) -> Response | None:
    """The 401 for a request that is not even signed or not fresh, given before its body is read."""
    try:
        check_headers(request.headers)
    except SignatureError as error:
        return _reply(f"request refused: {error}", 401)
    return None


async def handle(request: Request, body: bytes, callbacks: SlackCallbacks) -> Response:
    try:
        verify(body, request.headers)
    except SignatureError as error:
        return _reply(f"request refused: {error}", 401)
    try:
        click = parse_click(body)
    except InteractionError as error:
        return _reply(str(error), 400)
    if click is None:
        return _reply("ok")  # a link button or another action: nothing to do
    approver_ids = await anyio.to_thread.run_sync(callbacks.approvers)
    if not is_approver(click, approver_ids):
        return _reply(f"{click.user_name} is not an approver for GPU Medic actions; nothing was changed")
    by = click.user_id
    standing, won = await anyio.to_thread.run_sync(callbacks.claim, click.incident, click.approved, by)
    if not won:
        return _reply(_already(click.incident, standing))
    answer: dict[str, object] = {"approved": click.approved, "by": by, "via": "slack"}
    try:
        await anyio.to_thread.run_sync(callbacks.resume, UUID(click.flow_run), answer)
    except Exception as error:  # already answered, timed out, or Prefect unreachable: say so
        if standing is not None and standing.id is not None:  # the next click may try again
            await anyio.to_thread.run_sync(callbacks.reopen, standing.id)
        return _reply(f"could not answer incident {click.incident}: {error}")
    verdict = "approved" if click.approved else "rejected"
    return _reply(f"{verdict} by {click.user_name}: incident {click.incident} goes on")


def _already(incident: str, standing: ApprovalRecord | None) -> str:
    """What the second click is told: the first answer stands, and whose it was."""
    if standing is None:
        return f"incident {incident} is not waiting for approval; nothing was changed"
    if standing.approved is None:
        return f"incident {incident}: the request timed out ({standing.via}); your click changed nothing"
    verdict = "approved" if standing.approved else "rejected"
    return f"incident {incident} was already {verdict} by {standing.by}; your click changed nothing"
