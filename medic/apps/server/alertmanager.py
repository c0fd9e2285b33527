"""Alertmanager webhooks to fault events (`POST /v1/alertmanager`, docs/prometheus.md).

Alertmanager posts a group of alerts (its webhook payload, version 4). Each firing alert becomes
one event by the alert mapping (medic/alerts.py); a resolved one is answered as ignored and
counted: the fault it reported stays a fact, and what to do about a node is the policy's call, not
the alert's. An alert the mapping cannot read, or a body that is not Alertmanager's, is kept in the
dead letter with the reason.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from medic.alerts import AlertMap, fault
from medic.apps.server.decode import Decoded
from medic.intake import MAX_LINE_BYTES, Rejection, parse_line

log = logging.getLogger("medic.apps.server.alertmanager")

RESOLVED = "resolved"  # the `reason` label of medic_alertmanager_ignored_total
# What a sender without a token is told it may offer: Alertmanager's http_config does either.
CHALLENGE = 'Bearer, Basic realm="medic"'


class Alert(BaseModel):
    """One alert of the payload, as docs/configuration.md#webhook_config of Alertmanager has it."""

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: AwareDatetime  # Alertmanager's name: when the alert began to fire
    fingerprint: str = Field(min_length=1, max_length=200)


class Payload(BaseModel):
    # endsAt, groupKey, groupLabels, commonLabels, ...: not read; each alert carries its own labels.
    model_config = ConfigDict(extra="ignore")

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    alerts: list[Alert]


class Ignored(BaseModel):
    index: int  # in the payload's `alerts`
    alertname: str | None
    fingerprint: str
    reason: str


@dataclass(slots=True)
class Translated:
    decoded: Decoded = field(default_factory=Decoded)
    ignored: list[Ignored] = field(default_factory=list)


def translate(body: bytes, remote: str, mapping: AlertMap) -> Translated:
    """One webhook body to the events of its firing alerts, the rejections, and what was ignored."""
    origin, text = f"alertmanager:{remote}", body.decode("utf-8", errors="replace")
    out = Translated()
    try:
        payload = Payload.model_validate(json.loads(text))
    except (ValueError, RecursionError) as error:  # ValidationError is a ValueError
        _keep(out.decoded, Rejection(origin, text, f"not an Alertmanager webhook (version 4): {_why(error)}"))
        return out
    for index, alert in enumerate(payload.alerts):
        name = alert.labels.get("alertname")
        if alert.status == "resolved":
            log.info("alert %s (%s) resolved: recorded, nothing to do", name, alert.fingerprint)
            reason = "resolved: a fault that ended is still a fault; nothing is undone"
            out.ignored.append(
                Ignored(index=index, alertname=name, fingerprint=alert.fingerprint, reason=reason)
            )
            continue
        where = f"{origin}:[{index}]"
        made = fault(alert.labels, alert.annotations, alert.startsAt, alert.fingerprint, mapping)
        parsed = parse_line(json.dumps(made), where) if isinstance(made, dict) else Rejection(where, "", made)
        if isinstance(parsed, Rejection):
            # The dead letter keeps the alert as sent, so it can be mapped and posted again.
            _keep(out.decoded, Rejection(where, alert.model_dump_json(), parsed.reason), index)
        else:
            out.decoded.events.append(parsed)
    return out


def _keep(decoded: Decoded, rejection: Rejection, index: int | None = None) -> None:
    raw = rejection.raw if len(rejection.raw) <= MAX_LINE_BYTES else rejection.raw[:1000]
    decoded.reject(Rejection(rejection.origin, raw, rejection.reason), index=index)


def _why(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        return f"{'.'.join(map(str, first['loc'])) or 'body'}: {first['msg']}"
    return f"{type(error).__name__}: {error}"[:300]
