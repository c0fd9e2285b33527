"""The shipped Grafana dashboard (deployments/grafana/gpu-medic.json) against Grafana's published
dashboard JSON schema (tests/fixtures/grafana/, README.md there says where it came from).

Grafana does not run here: the schema checks the JSON model Grafana imports, and the queries are
checked to name only metrics GPU Medic exports (docs/serve.md's Metrics table) and the Prometheus
datasource variable."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema
import pytest
from checkout import REPO_ROOT, TEST_FIXTURES

DASHBOARD = REPO_ROOT / "deployments" / "grafana" / "gpu-medic.json"
SCHEMA = TEST_FIXTURES / "grafana" / "dashboard.jsonschema.json"


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_matches_grafanas_schema() -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator().iter_errors(load())]
    assert errors == []


@pytest.mark.parametrize(
    "breakage",
    [
        lambda d: d.pop("templating"),
        lambda d: d["panels"][1]["gridPos"].update(w=30),
        lambda d: d["panels"][1].update(query="a key Grafana does not know"),
    ],
    ids=["no templating", "panel wider than the grid", "unknown panel key"],
)
def test_the_schema_would_catch_a_broken_dashboard(breakage: Any) -> None:
    broken = copy.deepcopy(load())
    breakage(broken)
    assert not validator().is_valid(broken)


def test_queries_use_the_prometheus_variable_and_real_metrics() -> None:
    dashboard = load()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    documented = set(re.findall(r"`(medic_[a-z_]+)", (REPO_ROOT / "docs" / "serve.md").read_text()))
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"\b(medic_[a-z_]+)", target["expr"]):
                base = re.sub(r"_(bucket|count|sum)$", "", name)
                assert name in documented or base in documented, (panel["title"], name)
