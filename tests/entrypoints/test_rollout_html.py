"""`medic rollout report --html`'s page (medic/apps/cli/rollout_html.py), read back with html.parser: it holds
the JSON report's numbers, one plot per group, and loads nothing from elsewhere."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rollout_support import CANARY_POLICY, seed
from typer.testing import CliRunner

from medic.apps.cli.app import app
from medic.apps.cli.rollout_html import COUNTS, rollout_page
from medic.policy.loader import parse_policy
from medic.rollout import RolloutReport
from medic.store import Store

NOW = datetime.now(UTC).replace(microsecond=0)


class Page(HTMLParser):
    """Per group section: its tables (caption → rows of cell texts), its plots and their SVG marks;
    and every tag and attribute of the page, to check that it loads nothing."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.tables: dict[str, dict[str, list[list[str]]]] = {}
        self.plots: dict[str, int] = {}
        self.marks: dict[str, dict[str, int]] = {}
        self.readiness: dict[str, str] = {}
        self._group: str | None = None
        self._caption: str | None = None
        self._cells: list[str] | None = None
        self._text: list[str] | None = None
        self._in: str | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        self.tags.append((tag, attributes))
        if tag == "section" and attributes.get("data-group") is not None:
            self._group = attributes["data-group"]
            self.tables[self._group or ""] = {}
            self.marks[self._group or ""] = {}
        elif self._group is None:
            return
        elif tag == "figure":
            self.plots[self._group] = self.plots.get(self._group, 0) + 1
        elif tag in ("rect", "circle", "polyline"):
            marks = self.marks[self._group]
            marks[tag] = marks.get(tag, 0) + 1
        elif tag in ("caption", "td", "th", "p"):
            self._in, self._text = tag, []
        elif tag == "tr":
            self._cells = []

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._group is None:
            return
        if tag == self._in and self._text is not None:
            text = "".join(self._text).strip()
            if tag == "caption":
                self._caption = text
                self.tables[self._group][text] = []
            elif tag == "p":
                self.readiness[self._group] = text
            elif self._cells is not None:
                self._cells.append(text)
            self._in, self._text = None, None
        elif tag == "tr" and self._cells is not None and self._caption is not None:
            if self._cells and not self._text:
                self.tables[self._group][self._caption].append(self._cells)
            self._cells = None
        elif tag == "section":
            self._group = None


@pytest.fixture
def built(sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> RolloutReport:
    seed(sqlite_store, monkeypatch, NOW - timedelta(days=10))
    policy = parse_policy(CANARY_POLICY, "p.yaml")
    return sqlite_store.rollout_report(policy, since=NOW - timedelta(days=30), now=NOW)


def test_the_page_holds_the_numbers_of_the_json_report(built: RolloutReport) -> None:
    page = Page(rollout_page(built))
    assert sorted(page.tables) == sorted(g.name for g in built.groups) == ["*", "canary"]
    for g in built.groups:
        counts = {row[0]: row[1] for row in page.tables[g.name]["Counts"][1:]}  # after the header row
        assert {key: counts[label] for key, label in COUNTS} == {
            key: str(getattr(g, key)) for key, _ in COUNTS
        }
        assert counts["minutes saved: total"] == f"{g.saved_minutes_total:.0f}"
        pairs = page.tables[g.name]["Would-have decisions beside what people did"][1:]
        assert [(row[1], row[4]) for row in pairs] == [(p.node, p.verdict) for p in g.pairs]
        missed = page.tables[g.name]["Our misses (people's actions GPU Medic saw nothing before)"][1:]
        assert [row[0] for row in missed] == g.missed
    canary = next(g for g in built.groups if g.name == "canary")
    assert (canary.agreed, canary.disagreed, canary.false_alarm, canary.our_misses) == (1, 1, 1, 1)
    assert page.readiness["canary"] == "Not ready: " + "; ".join(canary.readiness.reasons) + "."
    bar = {row[0]: row[1:] for row in page.tables["canary"]["Readiness"][1:]}
    assert bar["agreement, at least"] == ["50%", "33.3%"]  # the canary's own bar, from the policy


def test_one_plot_per_group_drawn_in_svg_and_nothing_loaded_from_elsewhere(built: RolloutReport) -> None:
    text = rollout_page(built)
    page = Page(text)
    assert page.plots == {"*": 1, "canary": 1}
    # canary: six outcome bars and seven bins of minutes saved; a point per day with a judged decision.
    canary = next(g for g in built.groups if g.name == "canary")
    days = {f"{p.decided_at:%Y-%m-%d}" for p in canary.pairs if p.verdict != "pending"}
    assert page.marks["canary"] == {"rect": 13, "polyline": 1, "circle": len(days)}
    assert text.count("<svg") == len(built.groups)
    assert not [tag for tag, _ in page.tags if tag in ("script", "link", "img", "iframe", "object")]
    assert not [
        value for _, attributes in page.tags for value in attributes.values() if value and "//" in value
    ]


def test_a_group_with_nothing_judged_says_so_instead_of_a_line(built: RolloutReport) -> None:
    other = next(g for g in built.groups if g.name == "*")
    page = rollout_page(built.model_copy(update={"groups": [other]}))
    assert "no decision judged yet" in page
    assert "<polyline" not in page


def test_the_cli_writes_the_page_beside_its_text(
    sqlite_store: Store, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seed(sqlite_store, monkeypatch, NOW - timedelta(days=10))
    monkeypatch.setenv("MEDIC_HOME", str(tmp_path))
    monkeypatch.setenv("MEDIC_DATABASE_URL", sqlite_store.url)
    out = tmp_path / "rollout.html"
    result = CliRunner().invoke(app, ["rollout", "report", "--html", str(out)])
    assert result.exit_code == 0, result.output
    assert "group canary" in result.stdout
    assert f"wrote {out}" in result.stderr
    assert Page(out.read_text(encoding="utf-8")).plots == {"*": 1, "canary": 1}
