"""`POST /v1/alertmanager`: Alertmanager's webhook (version 4) with dcgm-exporter alerts to fault events."""

from __future__ import annotations

import base64
import json
import logging
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from checkout import TEST_FIXTURES
from fastapi import FastAPI
from test_server import BEARER, TOKEN, make_app, samples, serving
from typer.testing import CliRunner

from medic.alerts import ALERT_MAP_ENV, fault, load_alert_map, shipped_map
from medic.apps.cli.app import app as cli
from medic.apps.server.main import ServeConfigError, serve
from medic.events import EventKind, FaultEvent
from medic.policy import PolicyError
from medic.store import Store

FIXTURES = TEST_FIXTURES / "alertmanager"
STARTED = datetime(2025, 3, 1, 12, 0, 0, 123000, tzinfo=UTC)  # firing_xid.json's startsAt
DAY = (datetime(2025, 3, 1, tzinfo=UTC), datetime(2025, 3, 2, tzinfo=UTC))


def payload(name: str, **alert: Any) -> dict[str, Any]:
    """A fixture, its first alert's labels, annotations or fields replaced (None: removed)."""
    document = json.loads((FIXTURES / f"{name}.json").read_text())
    first = document["alerts"][0]
    for key, value in alert.items():
        if value is None:
            first.pop(key, None)
        elif isinstance(value, dict):
            first[key] = {k: v for k, v in (first[key] | value).items() if v is not None}
        else:
            first[key] = value
    return document


def basic(password: str, user: str = "alertmanager") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def am_app(store: Store, handed_on: list[FaultEvent] | None = None, **options: Any) -> FastAPI:
    async def hand_on(events: list[FaultEvent]) -> None:
        (handed_on if handed_on is not None else []).extend(events)

    return make_app(store, on_accepted=hand_on, **options)


async def post(client: httpx.AsyncClient, document: Any, headers: dict[str, str] = BEARER) -> httpx.Response:
    return await client.post("/v1/alertmanager", json=document, headers=headers)


@pytest.mark.anyio
async def test_a_firing_xid_alert_is_an_xid_event_on_its_hostname_gpu_and_start(sqlite_store: Store) -> None:
    handed_on: list[FaultEvent] = []
    async with serving(am_app(sqlite_store, handed_on)) as client:
        response = await post(client, payload("firing_xid"))
    assert (response.status_code, response.json()) == (200, {"accepted": 1, "duplicates": [], "rejected": []})
    (stored,) = sqlite_store.events_between(*DAY)
    assert (stored.kind, stored.node, stored.gpu, stored.time, stored.source) == (
        EventKind.XID,
        "gpu-017",  # Hostname, not the scrape target 10.20.3.17
        3,
        STARTED,  # when it began to fire, not when it reached us
        "alertmanager",
    )
    assert stored.attributes["code"] == 79
    assert stored.attributes["uuid"] == "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
    assert (stored.attributes["alertname"], stored.attributes["dcgm_field"]) == (
        "GPUXidError",
        "DCGM_FI_DEV_XID_ERRORS",
    )
    assert [e.id for e in handed_on] == [stored.id]


@pytest.mark.anyio
async def test_alertmanagers_repeats_and_regroupings_of_one_firing_are_duplicates(store: Store) -> None:
    first = payload("firing_xid")
    # repeat_interval sends it again as it was; a regrouping sends it in another group.
    regrouped = first | {"groupKey": '{}:{Hostname="gpu-017"}', "groupLabels": {"Hostname": "gpu-017"}}
    later = payload("firing_xid", startsAt="2025-03-01T15:00:00Z")  # it fired again: a new fault
    async with serving(am_app(store)) as client:
        replies = [(await post(client, d)).json() for d in (first, first, regrouped, later)]
    (event_id,) = {e.id for e in store.events_between(*DAY) if e.time == STARTED}
    assert [r["accepted"] for r in replies] == [1, 0, 0, 1]
    assert [r["duplicates"] for r in replies] == [[], [event_id], [event_id], []]


@pytest.mark.anyio
async def test_a_resolved_alert_is_answered_ignored_counted_and_logged(
    sqlite_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    handed_on: list[FaultEvent] = []
    with caplog.at_level(logging.INFO, logger="medic.apps.server.alertmanager"):
        async with serving(am_app(sqlite_store, handed_on)) as client:
            response = await post(client, payload("resolved_xid"))
            values = samples((await client.get("/metrics")).text)
    assert response.status_code == 202
    (ignored,) = response.json()["ignored"]
    assert (ignored["index"], ignored["alertname"], ignored["fingerprint"]) == (
        0,
        "GPUXidError",
        "6c2e3a4b2f0d9e1a",
    )
    assert ignored["reason"].startswith("resolved")
    assert values[("medic_alertmanager_ignored_total", (("reason", "resolved"),))] == 1
    assert (sqlite_store.events_between(*DAY), handed_on, sqlite_store.rejections()) == ([], [], [])
    assert "GPUXidError (6c2e3a4b2f0d9e1a) resolved" in caplog.text


@pytest.mark.anyio
async def test_a_firing_and_a_resolved_alert_in_one_group(sqlite_store: Store) -> None:
    document = payload("firing_xid")
    document["alerts"].append(payload("resolved_xid", startsAt="2025-03-01T08:00:00Z")["alerts"][0])
    async with serving(am_app(sqlite_store)) as client:
        response = await post(client, document)
    assert response.status_code == 200
    assert (response.json()["accepted"], [i["index"] for i in response.json()["ignored"]]) == (1, [1])


@pytest.mark.anyio
async def test_an_alert_the_mapping_does_not_know_is_a_422_with_its_reason_and_dead_lettered(
    sqlite_store: Store,
) -> None:
    async with serving(am_app(sqlite_store)) as client:
        response = await post(client, payload("unknown_alert"))
    assert response.status_code == 422
    (problem,) = response.json()["rejected"]
    assert problem["index"] == 0
    assert "'NodeFilesystemSpaceFillingUp' has no dcgm_field label" in problem["error"]
    (kept,) = sqlite_store.rejections()
    assert json.loads(kept.raw)["fingerprint"] == "b1f7e0c3a9d25e48"  # the alert as sent
    assert sqlite_store.events_between(*DAY) == []


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("alert", "reason"),
    [
        ({"annotations": {"value": "NaN"}}, "annotation value='NaN' is not a whole number"),
        ({"annotations": {"value": None}}, "annotation value='' is not a whole number"),
        ({"labels": {"Hostname": None, "instance": None}}, "no node: the alert has none of the labels"),
        ({"labels": {"dcgm_field": "DCGM_FI_DEV_GPU_TEMP"}}, "dcgm_field 'DCGM_FI_DEV_GPU_TEMP' is not in"),
        ({"annotations": {"value": "1001"}}, "attributes.code"),  # an XID code past the catalog
    ],
)
async def test_an_alert_that_cannot_be_mapped_is_kept_with_why(
    sqlite_store: Store, alert: dict[str, Any], reason: str
) -> None:
    async with serving(am_app(sqlite_store)) as client:
        response = await post(client, payload("firing_xid", **alert))
    assert response.status_code == 422
    assert reason in response.json()["rejected"][0]["error"]
    assert len(sqlite_store.rejections()) == 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "not an Alertmanager webhook (version 4): JSONDecodeError"),
        (json.dumps(payload("firing_xid") | {"version": "3"}).encode(), "version: Input should be '4'"),
        (json.dumps({"version": "4", "status": "firing"}).encode(), "alerts: Field required"),
        (json.dumps([payload("firing_xid")]).encode(), "body: Input should be a valid dictionary"),
    ],
)
async def test_a_body_that_is_not_alertmanagers_is_a_422_and_kept(
    sqlite_store: Store, body: bytes, reason: str
) -> None:
    async with serving(am_app(sqlite_store)) as client:
        response = await client.post("/v1/alertmanager", content=body, headers=BEARER)
    assert response.status_code == 422
    assert reason in response.json()["rejected"][0]["error"]
    (kept,) = sqlite_store.rejections()
    assert kept.raw == body.decode()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("headers", "status"),
    [
        (BEARER, 200),
        (basic(TOKEN), 200),
        (basic(TOKEN, user=""), 200),  # any user name: the password is the token
        (basic("guess"), 401),
        ({"Authorization": "Basic !!not-base64"}, 401),
        ({"Authorization": f"Bearer {TOKEN}x"}, 401),
        ({}, 401),
    ],
)
async def test_a_token_as_bearer_or_as_basic_auth_password(
    sqlite_store: Store, headers: dict[str, str], status: int
) -> None:
    async with serving(am_app(sqlite_store)) as client:
        response = await post(client, payload("firing_xid"), headers)
    assert response.status_code == status
    if status == 401:
        assert response.headers["WWW-Authenticate"] == 'Bearer, Basic realm="medic"'
        assert (sqlite_store.events_between(*DAY), sqlite_store.rejections()) == ([], [])


SITE_MAP = """\
# A site whose Prometheus relabels the node into `node`, and that has an XID alert of its own.
node_labels: [node, instance]
alerts:
  SiteGpuXid:
    field: DCGM_FI_DEV_XID_ERRORS
  SiteGpuOverheat:
    kind: thermal
    attributes: {throttle_reasons: [hw_thermal_slowdown]}
"""


@pytest.mark.anyio
async def test_a_site_mapping_is_merged_over_the_shipped_one(sqlite_store: Store, tmp_path: Path) -> None:
    site = tmp_path / "alerts.yaml"
    site.write_text(SITE_MAP)
    mapping = load_alert_map({ALERT_MAP_ENV: str(site)})
    assert mapping.fields == shipped_map().fields  # the shipped fields stay
    own = payload("firing_xid", labels={"alertname": "SiteGpuXid", "dcgm_field": None, "Hostname": None})
    overheat = payload(
        "firing_xid",
        labels={"alertname": "SiteGpuOverheat", "dcgm_field": None, "node": "gpu-018"},
        annotations={"value": "91.5"},
        fingerprint="0f0e0d0c0b0a0908",
    )
    async with serving(am_app(sqlite_store, alert_map=mapping)) as client:
        replies = [(await post(client, d)).json() for d in (own, overheat)]
    assert [r["accepted"] for r in replies] == [1, 1]
    by_kind = {e.kind: e for e in sqlite_store.events_between(*DAY)}
    assert (by_kind[EventKind.XID].node, by_kind[EventKind.XID].attributes["code"]) == ("10.20.3.17", 79)
    thermal = by_kind[EventKind.THERMAL]
    assert (thermal.node, thermal.attributes["throttle_reasons"], thermal.attributes["value"]) == (
        "gpu-018",
        ["hw_thermal_slowdown"],
        91.5,
    )


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (
            "alerts:\n  Mine:\n    field: DCGM_FI_NOPE\n",
            3,
            "alerts.Mine.field: DCGM_FI_NOPE is not under `fields`",
        ),
        ("fields:\n  F:\n    kind: xid\n", 3, "a xid event's code: Field required"),
        (
            "fields:\n  F:\n    kind: dcgm_health\n    attributes: {error_id: DCGM_FR_NOPE}\n",
            3,
            "no DCGM error",
        ),
        ("alerts:\n  A:\n    kind: xid\n    value_as: code\n    field: X\n", 3, "give either `field`"),
        ("node_labels: [host-name]\n", 1, "node_labels.0: String should match pattern"),
        ("fields: [\n", 2, "invalid YAML"),
        ("feilds: {}\n", 1, "feilds: unknown key"),
    ],
)
def test_a_broken_site_mapping_is_refused_at_its_file_and_line(
    tmp_path: Path, text: str, line: int, message: str
) -> None:
    site = tmp_path / "alerts.yaml"
    site.write_text(text)
    with pytest.raises(PolicyError) as refused:
        load_alert_map({ALERT_MAP_ENV: str(site)})
    assert f"{site}:{line}:" in str(refused.value)
    assert message in str(refused.value)


def test_medic_alerts_check_says_what_serve_would_refuse_at_its_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good, broken = tmp_path / "alerts.yaml", tmp_path / "broken.yaml"
    good.write_text(SITE_MAP)
    broken.write_text("alerts:\n  Mine:\n    field: DCGM_FI_NOPE\n")
    shipped = shipped_map()
    done = CliRunner().invoke(cli, ["alerts", "check", str(good), str(broken)])
    assert done.exit_code == 1
    assert done.stdout == (
        f"{good}: ok, merged over the shipped mapping ({len(shipped.fields)} fields, 0 added; 2 alerts, "
        "2 added; node from node, instance)\n"
    )
    assert re.fullmatch(
        rf"{broken}:3:\d+: alerts.Mine.field: DCGM_FI_NOPE is not under `fields`\n", done.stderr
    )
    # Without a file, the one MEDIC_ALERT_MAP names: what `medic serve` will load.
    monkeypatch.setenv(ALERT_MAP_ENV, str(good))
    named = CliRunner().invoke(cli, ["alerts", "check"])
    assert (named.exit_code, named.stdout.split(":")[0]) == (0, str(good))


def test_medic_serve_does_not_start_with_a_broken_site_mapping(tmp_path: Path) -> None:
    site = tmp_path / "alerts.yaml"
    site.write_text("alerts:\n  Mine:\n    field: DCGM_FI_NOPE\n")
    env = {"MEDIC_INGEST_TOKENS": TOKEN, ALERT_MAP_ENV: str(site), "MEDIC_HOME": str(tmp_path)}
    with pytest.raises(ServeConfigError, match=rf"{site}:3:\d+: alerts.Mine.field"):
        serve(env=env)


@pytest.mark.parametrize(
    ("labels", "node"),
    [
        ({"Hostname": "gpu-017", "instance": "10.0.0.1:9400"}, "gpu-017"),
        ({"hostname": "gpu-017", "instance": "10.0.0.1:9400"}, "gpu-017"),  # dcgm-exporter's main branch
        ({"instance": "gpu-017.cluster:9400"}, "gpu-017.cluster"),
        ({"instance": "[fd00::17]:9400"}, "fd00::17"),
        ({"instance": "fd00::17"}, "fd00::17"),  # no port to strip
        ({"Hostname": " ", "instance": "gpu-017"}, "gpu-017"),
    ],
)
def test_the_node_is_the_first_node_label_set_without_its_port(labels: dict[str, str], node: str) -> None:
    made = fault(
        {"dcgm_field": "DCGM_FI_DEV_XID_ERRORS"} | labels, {"value": "79"}, STARTED, "fp", shipped_map()
    )
    assert isinstance(made, dict)
    assert made["node"] == node


def test_every_shipped_field_makes_a_valid_event() -> None:
    for field in shipped_map().fields:
        made = fault(
            {"dcgm_field": field, "Hostname": "gpu-017"}, {"value": "2"}, STARTED, "fp", shipped_map()
        )
        assert isinstance(made, dict)
        FaultEvent.model_validate(made)
