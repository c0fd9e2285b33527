"""Prometheus alerts to fault events: the mapping (docs/prometheus.md#alertmanager--gpu-medic).

An alert about a dcgm-exporter metric names it in its `dcgm_field` label; the mapping says which
event kind that metric is evidence of, and which attribute takes the alert's `value` annotation.
The shipped mapping (medic/data/alertmanager.yaml) covers the fields the shipped rules alert on; a
site's file (MEDIC_ALERT_MAP) is merged over it, and is checked as a policy file is, every problem at
its file:line:column.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from medic import dcgm_errors
from medic.events import ATTRIBUTE_MODELS, EventKind
from medic.policy.loader import Located, decode_policy, parse_yaml, read_limited
from medic.shipped import ALERT_MAP

ALERT_MAP_ENV = "MEDIC_ALERT_MAP"
FIELD_LABEL = "dcgm_field"  # the contract with the shipped alert rules (deployments/prometheus/)
VALUE_ANNOTATION = "value"  # "{{ $value }}": Prometheus keeps the series value out of the labels
SOURCE = "alertmanager"
# Labels dcgm-exporter puts on every GPU series, kept with the event for whoever reads it.
KEPT_LABELS = {"UUID": "uuid", "pci_bus_id": "pci_bus_id", "modelName": "model", "device": "device"}
MAX_MESSAGE_CHARS = 500

LabelName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KindRule(_Strict):
    """What an alert is evidence of: a kind, fixed attributes, and where the alert's value goes."""

    kind: EventKind
    value_as: str | None = Field(None, min_length=1, max_length=200)
    attributes: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _makes_valid_events(self) -> KindRule:
        # Checked now, with a stand-in value, so a wrong mapping stops `medic serve` at its start
        # instead of dead-lettering every alert it maps.
        sample = self.attributes | ({self.value_as: 1} if self.value_as else {})
        try:
            ATTRIBUTE_MODELS[self.kind].model_validate(sample)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(map(str, first["loc"])) or "attributes"
            raise ValueError(f"a {self.kind.value} event's {where}: {first['msg']}") from None
        error_id = self.attributes.get("error_id")
        if self.kind is EventKind.DCGM_HEALTH and dcgm_errors.lookup(str(error_id)) is None:
            raise ValueError(f"error_id {error_id!r} is no DCGM error (medic/data/dcgm_errors.csv)")
        return self


class AlertRule(_Strict):
    """An alert known by its `alertname`: the dcgm-exporter field it is about, or a kind of its own."""

    field: str | None = Field(None, min_length=1)
    kind: EventKind | None = None
    value_as: str | None = Field(None, min_length=1, max_length=200)
    attributes: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_way(self) -> AlertRule:
        if (self.field is None) == (self.kind is None):
            raise ValueError("give either `field` (a dcgm-exporter field of `fields`) or `kind`")
        if self.field is not None and (self.value_as or self.attributes):
            raise ValueError("`field` takes its kind, value_as and attributes from that field's entry")
        if self.kind is not None:
            KindRule(kind=self.kind, value_as=self.value_as, attributes=self.attributes)
        return self


class AlertMap(_Strict):
    node_labels: list[LabelName] = Field(min_length=1)
    fields: dict[str, KindRule] = Field(default_factory=dict)
    alerts: dict[str, AlertRule] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _fields_known(self) -> AlertMap:
        known = set(self.fields) | self._inherited_fields()
        for name, rule in self.alerts.items():
            if rule.field is not None and rule.field not in known:
                raise Located(("alerts", name, "field"), f"{rule.field} is not under `fields`")
        return self

    def _inherited_fields(self) -> set[str]:
        return set()

    def rule_for(self, labels: Mapping[str, str]) -> tuple[str, KindRule] | str:
        """The rule for an alert, with the key its event id is made from; or why there is none."""
        field = labels.get(FIELD_LABEL)
        if field:
            rule = self.fields.get(field)
            return (field, rule) if rule else f"{FIELD_LABEL} {field[:100]!r} is not in the alert mapping"
        name = labels.get("alertname", "")
        by_name = self.alerts.get(name)
        if by_name is None:
            return (
                f"alert {name[:100]!r} has no {FIELD_LABEL} label and its name is not in the alert mapping "
                f"(map it under `alerts:` in the {ALERT_MAP_ENV} file)"
            )
        if by_name.field is not None:
            return by_name.field, self.fields[by_name.field]
        assert by_name.kind is not None  # AlertRule holds one or the other
        return f"alert:{name}", KindRule(
            kind=by_name.kind, value_as=by_name.value_as, attributes=by_name.attributes
        )

    def node(self, labels: Mapping[str, str]) -> str | None:
        value = next((labels[n].strip() for n in self.node_labels if labels.get(n, "").strip()), None)
        return _host(value) if value is not None else None


class SiteAlertMap(AlertMap):
    """A site's file: what it names is merged over the shipped mapping, which its alerts may refer to."""

    node_labels: list[LabelName] = Field(default_factory=list)

    def _inherited_fields(self) -> set[str]:
        return set(shipped_map().fields)


def _host(value: str) -> str:
    """`host:port` (the scrape target, `instance`) to the host; `[v6]:port` to the address."""
    if value.startswith("[") and "]" in value:
        return value[1 : value.index("]")]
    host, colon, port = value.rpartition(":")
    return host if colon and host and ":" not in host and port.isascii() and port.isdigit() else value


def _parse(path: Path, model: type[AlertMap]) -> AlertMap:
    name = str(path)
    return parse_yaml(decode_policy(read_limited(path), name), name, model, "a mapping with `fields:`")


@functools.cache
def shipped_map() -> AlertMap:
    return _parse(ALERT_MAP, AlertMap)


def load_alert_map(env: Mapping[str, str]) -> AlertMap:
    """The shipped mapping, with the file MEDIC_ALERT_MAP names merged over it; PolicyError
    (every problem at file:line:column) when that file is unreadable or wrong."""
    shipped, path = shipped_map(), env.get(ALERT_MAP_ENV, "").strip()
    if not path:
        return shipped
    site = _parse(Path(path), SiteAlertMap)
    return AlertMap.model_construct(
        node_labels=site.node_labels or shipped.node_labels,
        fields=shipped.fields | site.fields,
        alerts=shipped.alerts | site.alerts,
    )


def fault(
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    starts_at: datetime,
    fingerprint: str,
    mapping: AlertMap,
) -> dict[str, Any] | str:
    """The fault event (not yet validated: intake does that) for one firing alert, or why there is none."""
    found = mapping.rule_for(labels)
    if isinstance(found, str):
        return found
    key, rule = found
    node = mapping.node(labels)
    if node is None:
        return f"no node: the alert has none of the labels {', '.join(mapping.node_labels)}"
    attributes = dict(rule.attributes)
    raw = annotations.get(VALUE_ANNOTATION)
    value = _number(raw)
    if rule.value_as:
        if value is None or not value.is_integer():
            return (
                f"annotation {VALUE_ANNOTATION}={(raw or '')[:40]!r} is not a whole number, and {key} "
                f"takes it as {rule.value_as} (annotate the rule with {VALUE_ANNOTATION}: '{{{{ $value }}}}')"
            )
        attributes[rule.value_as] = int(value)
    elif raw is not None:
        if value is None:
            return f"annotation {VALUE_ANNOTATION}={raw[:40]!r} is not a number"
        attributes[VALUE_ANNOTATION] = value
    message = annotations.get("summary") or annotations.get("description")
    context = {
        "alertname": labels.get("alertname"),
        FIELD_LABEL: labels.get(FIELD_LABEL),
        "fingerprint": fingerprint,
        "message": message[:MAX_MESSAGE_CHARS] if message else None,
    } | {ours: labels.get(theirs) for theirs, ours in KEPT_LABELS.items()}
    event: dict[str, Any] = {
        "id": event_id(fingerprint, starts_at, key),
        "time": starts_at.isoformat(),  # when the fault began, whenever Alertmanager tells us
        "source": SOURCE,
        "kind": rule.kind.value,
        "node": node,
        "attributes": {k: v for k, v in context.items() if v} | attributes,
    }
    gpu = labels.get("gpu", "")
    if gpu.isascii() and gpu.isdigit():
        event["gpu"] = int(gpu)
    return event


def event_id(fingerprint: str, starts_at: datetime, key: str) -> str:
    """One id per firing of one alert: Alertmanager sends it again at every repeat_interval and
    whenever its group changes, always with the same fingerprint (its label set) and startsAt. A
    digest, so that any fingerprint a sender makes up is bounded and safe as an id."""
    instant = f"{starts_at.timestamp():.6f}"  # the instant, however its offset was written
    digest = hashlib.sha256("\0".join((fingerprint, instant, key)).encode("utf-8", "surrogatepass"))
    return f"am-{digest.hexdigest()[:32]}"


def _number(raw: str | None) -> float | None:
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None
