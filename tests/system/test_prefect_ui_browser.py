"""The Prefect UI tells an incident's story, as a person sees it: a real `prefect server` serving its
web UI on a port of its own, one incident run through the real flow against it, and the flow run's
page opened in headless Chromium (Debian's `chromium`, driven by playwright).

The screenshot it takes is docs/img/prefect-ui-flow-run.png; MEDIC_UI_SCREENSHOT=PATH writes it
there too, to refresh the docs' copy.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from uuid import UUID

import pytest
from bench.prefect_server import prefect_on_postgres
from checkout import REPO_ROOT
from factories import event_line
from playwright.sync_api import expect, sync_playwright
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from medic.flows.dispatch import remediate_all
from medic.intake import read_lines
from medic.integrations import registry
from medic.integrations.sim.fleet import SimFleet
from medic.store import Store
from medic.tasks.runtime.process import Runtime, configure

pytestmark = pytest.mark.system

CHROMIUM = "/usr/bin/chromium"
NODE = "gpu-node-1"
# What the run's page must show: the steps under the names they ran as, and the log's story.
STEPS = (f"act: reboot {NODE}", f"verify L1 {NODE}", "resume job llm")
STORY = (f"act: reboot on {NODE} (rule xid-fallen-off-bus) → ok", f"verify L1 on {NODE} → ok")
TAGS = (f"node:{NODE}", "action:reboot", "classification:hardware", "rule:xid-fallen-off-bus", "owner:alice")


@dataclass(frozen=True, slots=True)
class HandledIncident:
    ui: str  # the UI's address, as browsers reach it
    incident: str
    flow_run_id: str


@pytest.fixture(scope="module")
def ui_api(tmp_path_factory: pytest.TempPathFactory, postgres_admin_url: str) -> Iterator[str]:
    with prefect_on_postgres(tmp_path_factory.mktemp("prefect-ui"), postgres_admin_url, ui=True) as api:
        yield api


@pytest.fixture(scope="module")
def handled(ui_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HandledIncident]:
    """An XID 79 under a training job, remediated in this process by the real flow on that server."""
    fleet = SimFleet.build(nodes=8)
    fleet.add_job("llm", "alice", [NODE, "gpu-node-2"], step=1_234, checkpoint_every=100)
    fleet.crash_job("llm")
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('medic') / 'medic.db'}")
    rt = configure(Runtime(store, registry.simulated(fleet)[0], REPO_ROOT / "policies" / "default.yaml"))
    fault = event_line("xid", node=NODE, gpu=3, job="llm", at=datetime.now(UTC), code=79)
    with temporary_settings({PREFECT_API_URL: ui_api}):
        # Prefect keeps one events worker per process for any running server, bound to the first one
        # it met: an earlier test's, gone by now. Task runs travel as events, so start it afresh.
        EventsWorker.drain_all()
        (outcome,) = asyncio.run(remediate_all(rt, read_lines([fault], "ui.jsonl"))).outcomes
        record = store.get_incident(outcome.incident)
        assert record is not None and record.flow_run_id is not None
        asyncio.run(_until_recorded(UUID(record.flow_run_id)))
        # And leave none bound to this server, which stops with the module: draining one bound to a
        # gone server would hold the session's last teardown (prefect_test_harness drains them all).
        EventsWorker.drain_all()
        APILogWorker.drain_all()
    yield HandledIncident(ui_api.removesuffix("/api"), outcome.incident, record.flow_run_id)
    store.close()


async def _until_recorded(flow_run_id: UUID, timeout_s: float = 20) -> None:
    """Task runs and log lines reach the server in the background (events, batched logs): wait for
    the last of them, so the page shows the whole run when it is opened."""
    deadline = time.monotonic() + timeout_s
    async with get_client() as client:
        while True:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
            logs = await client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            )
            names = {r.name for r in runs if r.state is not None and r.state.is_final()}
            if set(STEPS) <= names and any(m.message.startswith("close") for m in logs):
                return
            assert time.monotonic() < deadline, f"the server has {sorted(names)} and {len(logs)} log lines"
            await asyncio.sleep(0.5)


def test_an_incidents_flow_run_page_shows_its_tags_steps_story_and_audit(
    handled: HandledIncident, tmp_path: Path
) -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (scripts/test.sh does)")
    shot = tmp_path / "prefect-ui-flow-run.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            page.goto(f"{handled.ui}/runs/flow-run/{handled.flow_run_id}")
            # The UI reads the run through the API it was told (PREFECT_UI_API_URL): no "Oops".
            expect(page.get_by_text(f"{handled.incident}-{NODE}").first).to_be_visible(timeout=15_000)
            for text in (*TAGS, *STEPS, *STORY):
                expect(page.get_by_text(text).first).to_be_visible()
            page.wait_for_load_state("networkidle")
            page.screenshot(path=shot)

            page.get_by_text("Artifacts", exact=True).click()
            expect(page.get_by_text(f"{handled.incident}-record", exact=True)).to_be_visible()  # the link
            page.get_by_text(handled.incident, exact=True).click()
            expect(page.get_by_role("heading", name="Decisions")).to_be_visible()
            audit = page.locator("body").inner_text()
        finally:
            browser.close()
    # Each decision once, the actions in the order they were carried out.
    assert audit.count("(hardware) by rule xid-fallen-off-bus") == 1, audit
    done = [audit.index(f"{action} on {NODE}: succeeded") for action in ("drain", "reboot", "resume")]
    assert done == sorted(done), audit
    assert shot.stat().st_size > 20_000
    if docs_copy := os.environ.get("MEDIC_UI_SCREENSHOT"):
        shutil.copyfile(shot, docs_copy)
