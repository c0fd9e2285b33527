"""Rendering a `Message` as Slack Block Kit blocks and the plain-text fallback that notifications show.

Slack rejects a whole message when one block breaks a limit (`invalid_blocks`), so every piece of text is
cut to its block's limit here rather than trusted to be short.
"""

from __future__ import annotations

import json
from typing import Any

from medic.artifacts import Artifact, ArtifactLinks
from medic.protocols import Message

# Block Kit limits (https://docs.slack.dev/reference/block-kit/blocks).
HEADER_MAX = 150
SECTION_TEXT_MAX = 3000
FIELD_TEXT_MAX = 2000
FIELDS_MAX = 10
CONTEXT_TEXT_MAX = 2000
URL_MAX = 3000
# Slack truncates a message's `text` at 40,000 characters but advises staying under 4,000.
TEXT_MAX = 4000

ELLIPSIS = "…"
FIELD_LABELS = {"gpu": "GPU"}
RECOMMEND_HEADING = "*Recommended actions*\n"
ARTIFACTS_HEADING = "*Evidence files*\n"
ARTIFACT_WHAT_MAX = 200
ARTIFACT_PATH_MAX = 500

Block = dict[str, Any]


def escape(text: str) -> str:
    """Slack reads &, < and > as markup (links, mentions), so literal ones must be entities."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + ELLIPSIS


def fit_mrkdwn(raw: str, limit: int) -> str:
    """`raw` escaped for mrkdwn and at most `limit` characters long, cut before escaping so that no
    entity is split in half."""
    escaped = escape(raw)
    if len(escaped) <= limit:
        return escaped
    cut = raw[: limit - 1]
    while (overshoot := len(escape(cut)) + len(ELLIPSIS) - limit) > 0:
        cut = cut[:-overshoot]
    return escape(cut) + ELLIPSIS


def _label(key: str) -> str:
    return FIELD_LABELS.get(key, key[:1].upper() + key[1:])


def _mrkdwn(text: str) -> Block:
    return {"type": "mrkdwn", "text": text}


def _fields(fields: dict[str, str]) -> list[Block]:
    shown = [(key, value) for key, value in fields.items() if value][:FIELDS_MAX]
    out = []
    for key, value in shown:
        label = f"*{fit_mrkdwn(_label(key), FIELD_TEXT_MAX // 2)}*\n"
        out.append(_mrkdwn(label + fit_mrkdwn(value, FIELD_TEXT_MAX - len(label))))
    return out


def _recommendations(recommend: tuple[str, ...]) -> str:
    bullets = "\n".join(f"• {item}" for item in recommend)
    return RECOMMEND_HEADING + fit_mrkdwn(bullets, SECTION_TEXT_MAX - len(RECOMMEND_HEADING))


def _artifact_line(artifact: Artifact, links: ArtifactLinks | None) -> str:
    """A link where the file is served, else its path as code: a path is no link in Slack."""
    what = fit_mrkdwn(artifact.what, ARTIFACT_WHAT_MAX)
    url = links.url(artifact.path) if links else None
    if url is not None and len(url) <= URL_MAX:
        return f"• <{escape(url)}|{what}>"
    path = artifact.path.replace("`", "'")  # a backtick would end the code span early
    return f"• {what}: `{fit_mrkdwn(path, ARTIFACT_PATH_MAX)}`"


def _artifacts(artifacts: tuple[Artifact, ...], links: ArtifactLinks | None) -> str:
    """As many lines as fit the section, whole: a link cut in half would be no link."""
    text = ARTIFACTS_HEADING
    for shown, artifact in enumerate(artifacts):
        line = _artifact_line(artifact, links) + "\n"
        more = f"… and {len(artifacts) - shown} more"
        if len(text) + len(line) + len(more) > SECTION_TEXT_MAX:
            return text + more
        text += line
    return text.rstrip("\n")


APPROVE_ACTION = "medic_approve"
REJECT_ACTION = "medic_reject"


def _approval_buttons(message: Message) -> list[Block]:
    """Approve / Reject for a paused flow run; the button's value carries the run to resume."""
    if not message.approval_run:
        return []
    value = json.dumps({"flow_run": message.approval_run, "incident": message.incident})
    return [
        {
            "type": "button",
            "action_id": APPROVE_ACTION,
            "style": "primary",
            "text": {"type": "plain_text", "text": "Approve"},
            "value": value,
        },
        {
            "type": "button",
            "action_id": REJECT_ACTION,
            "style": "danger",
            "text": {"type": "plain_text", "text": "Reject"},
            "value": value,
        },
    ]


def title_of(message: Message) -> str:
    return message.title.strip() or f"Incident {message.incident}"


def message_blocks(
    message: Message, flow_run_url: str | None = None, links: ArtifactLinks | None = None
) -> list[Block]:
    blocks: list[Block] = [
        {"type": "header", "text": {"type": "plain_text", "text": truncate(title_of(message), HEADER_MAX)}}
    ]
    if message.body.strip():
        blocks.append({"type": "section", "text": _mrkdwn(fit_mrkdwn(message.body, SECTION_TEXT_MAX))})
    fields = _fields(message.fields)
    if fields:
        blocks.append({"type": "section", "fields": fields})
    if message.recommend:
        blocks.append({"type": "section", "text": _mrkdwn(_recommendations(message.recommend))})
    if message.artifacts:
        blocks.append({"type": "section", "text": _mrkdwn(_artifacts(message.artifacts, links))})
    buttons = _approval_buttons(message)
    if flow_run_url and len(flow_run_url) <= URL_MAX:
        buttons.append(
            {
                "type": "button",
                "action_id": "open_flow_run",
                "text": {"type": "plain_text", "text": "Open flow run"},
                "url": flow_run_url,
            }
        )
    if buttons:
        blocks.append({"type": "actions", "elements": buttons})
    incident = fit_mrkdwn(message.incident, CONTEXT_TEXT_MAX - 40)
    blocks.append({"type": "context", "elements": [_mrkdwn(f"Incident `{incident}` · GPU Medic")]})
    return blocks


def fallback_text(message: Message) -> str:
    """What notifications and clients without Block Kit show: the title and the body."""
    return fit_mrkdwn(f"{title_of(message)}\n{message.body}".strip(), TEXT_MAX)
