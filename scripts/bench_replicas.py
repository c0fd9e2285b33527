#!/usr/bin/env python3
"""Reliability figures with two `medic serve` replicas: the scenarios of tests/system/test_replicas.py at
issue 14's sizes, printed as markdown (BENCHMARKS.md's reliability section is written from them).

Starts its own parts, as the tests do (tests/replicas_support.py): a `prefect server` on a fresh
PostgreSQL database (tests/bench/prefect_server.py), a store database of its own, a 20-node Slurm cluster
(scripts/slurm-cluster.sh, under /tmp/medic-slurm-replicas, on free ports) and two
`medic serve --dispatch local` processes. Needs root (Slurm) and PostgreSQL at 127.0.0.1:5432
(MEDIC_TEST_POSTGRES to use another).

    .venv/bin/python scripts/bench_replicas.py                 # all three, the issue's sizes
    .venv/bin/python scripts/bench_replicas.py --only kills --kills 40 --json kills.json
    .venv/bin/python scripts/bench_replicas.py --only slot     # a replica killed holding the guardrail slot

The figures: reboots per duplicated fault (the store's reboot/reset/replace rows, Slurm's reboot
requests and the reboots it carried out), incidents opened for one fault; the most nodes Slurm showed out
of service at once (sampled every 100 ms) against the limit; events acknowledged against stored;
incidents left unfinished after the last restart and the time everything took to settle.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests")]  # tests/bench and the tests' harness, as pytest sees them

from bench.prefect_server import DEFAULT_ADMIN_URL, prefect_on_postgres  # noqa: E402
from replicas_support import (  # noqa: E402
    ACTIVE,
    TERMINAL,
    Acks,
    DuplicateStorm,
    Harness,
    KillStorm,
    SimultaneousFaults,
    SlotHolderKill,
    dump,
    duplicate_storm,
    kill_slot_holder,
    kill_storm,
    left_out,
    simultaneous_faults,
    summarize,
)

SCENARIOS = ("duplicates", "simultaneous", "kills")  # issue 14's; "slot" runs only when named


def _s(seconds: float | None) -> str:
    return "never (see below)" if seconds is None else f"{seconds:.1f} s"


def _table(rows: list[tuple[str, Any]]) -> str:
    lines = ["| figure | value |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def duplicates_section(r: DuplicateStorm) -> str:
    store = ", ".join(f"{a.action} ({a.status})" for a in r.destructive) or "none"
    rows = [
        (
            "XID 79s for one node (new ids)",
            f"{r.events} over {r.posted_s:.1f} s, {r.sent_to_both} sent to both",
        ),
        (
            "POST answers",
            dict(r.acks.answered) | ({"no answer": sum(r.acks.failed.values())} if r.acks.failed else {}),
        ),
        ("events acknowledged / stored / lost", f"{len(r.acks.ids)} / {len(r.stored)} / {len(r.lost)}"),
        ("incidents for the node", f"{len(r.incidents)} ({summarize(r.incidents)})"),
        ("reboots in the store (reboot/reset/replace rows)", f"{len(r.destructive)}: {store}"),
        ("Slurm reboot requests / reboots carried out", f"{r.slurm_requests} / {r.slurm_reboots}"),
        ("Slack threads for the node", str(r.threads)),
        ("copies received after their incident ended (joined it)", str(r.late)),
        ("settled after the last POST", _s(r.settle_s)),
        ("scenario took", f"{r.took_s:.0f} s"),
    ]
    text = f"### {r.events} duplicate XID 79s for one node, two replicas\n\n{_table(rows)}\n"
    if len(r.incidents) > 1 or r.settle_problem:
        text += f"\nIncidents against the first POST: {r.timeline()}\n"
    return text + (f"\n{r.settle_problem}\n" if r.settle_problem else "")


def simultaneous_section(r: SimultaneousFaults) -> str:
    closed = sum(i.status == "closed" for i in r.incidents)
    by_guardrail = sum(i.status == "escalated" and "guardrail" in (i.outcome or "") for i in r.incidents)
    other = [
        i.describe()
        for i in r.incidents
        if i.status not in TERMINAL or (i.status == "escalated" and "guardrail" not in (i.outcome or ""))
    ]
    rows = [
        ("faults (one XID 79 per node)", f"{len(r.nodes)} within {r.posted_s:.1f} s"),
        ("events acknowledged / lost", f"{len(r.acks.ids)} / {len(r.lost)}"),
        ("most nodes out of service at once (Slurm) / limit", f"{len(r.max_out)} / {r.limit}"),
        ("Slurm samples (every 100 ms) / over the limit", f"{r.samples} / {len(r.over_limit)}"),
        ("nodes ever out of service", len(r.ever_out)),
        ("incidents: closed / escalated by a guardrail / other", f"{closed} / {by_guardrail} / {len(other)}"),
        ("settled after the last POST", _s(r.settle_s)),
        ("scenario took", f"{r.took_s:.0f} s"),
    ]
    text = f"### {len(r.nodes)} nodes faulting at once under max_out_of_service {r.limit}\n\n{_table(rows)}\n"
    if r.over_limit:
        text += (
            "\nOver the limit: " + "; ".join(f"+{at:.1f} s {sorted(n)}" for at, n in r.over_limit[:10]) + "\n"
        )
    if other:
        text += "\nOther outcomes: " + "; ".join(other[:10]) + "\n"
    return text + (f"\n{r.settle_problem}\n" if r.settle_problem else "")


def kills_section(r: KillStorm) -> str:
    restarts = [k.restart_s for k in r.kills]
    stuck = [i for i in r.incidents if i.status in ACTIVE]
    unfinished = [i for i in r.incidents if i.status not in TERMINAL]
    behind = left_out(r)
    twice = {n: c for n, c in (r.reboots_in_store | r.reboots_in_slurm).items() if c > 1}
    rows = [
        (
            "kill -9 (alternating replicas)",
            f"{len(r.kills)}: {sum(k.active > 0 for k in r.kills)} with an incident in progress, "
            f"{sum(bool(k.slot_taken) for k in r.kills)} while the guardrail slot was held",
        ),
        (
            "replica restart to /healthz: median / max",
            f"{statistics.median(restarts):.1f} s / {max(restarts):.1f} s",
        ),
        ("events acknowledged / stored / lost", f"{len(r.acks.ids)} / {r.stored} / {len(r.lost)}"),
        ("POSTs without an answer (killed or restarting replica)", sum(r.acks.failed.values())),
        ("incidents", f"{len(r.incidents)} ({summarize(r.incidents)})"),
        ("incidents stuck open/remediating/waiting after settling", len(stuck)),
        ("incidents neither closed nor escalated", len(unfinished)),
        ("events in no incident", len(r.unattached)),
        ("nodes taken out / left out without an escalated incident", f"{len(r.taken_out)} / {len(behind)}"),
        (
            "reboot/reset/replace rows in the store / reboots Slurm carried out",
            f"{sum(r.reboots_in_store.values())} / {sum(r.reboots_in_slurm.values())}",
        ),
        ("nodes acted on more than once for one fault", twice or 0),
        ("time to settle after the last restart", _s(r.settle_s)),
        ("scenario took", f"{r.took_s:.0f} s"),
    ]
    text = f"### {len(r.kills)} kill -9 mid-flow, faults on {len(r.nodes)} nodes\n\n{_table(rows)}\n"
    if stuck or unfinished:
        text += "\nUnfinished: " + "; ".join(i.describe() for i in unfinished[:10]) + "\n"
    if behind:
        text += "\nLeft out of service: " + "; ".join(f"{n}: {why}" for n, why in behind.items()) + "\n"
    return text + (f"\n{r.settle_problem}\n" if r.settle_problem else "")


def slot_section(r: SlotHolderKill) -> str:
    rows = [
        ("kill -9 of replica A while its run held the guardrail slot", "yes" if r.held_after_kill else "no"),
        (
            f"first action on {r.other_node} (replica B) after the kill",
            "none within the bound" if r.blocked_s is None else f"{r.blocked_s:.0f} s",
        ),
        ("waited at most", f"{r.bound_s:.0f} s"),
    ]
    return f"### kill -9 of the replica holding the guardrail slot\n\n{_table(rows)}\n"


def _figures(result: Any) -> dict[str, Any]:
    """A scenario's result as plain data: its fields, with the acknowledgements as counts and ids."""
    figures = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    if isinstance(acks := figures.get("acks"), Acks):
        figures["acks"] = {
            "acknowledged": sorted(acks.ids),
            "posts": acks.posts,
            "answered": acks.answered,
            "no answer": acks.failed,
        }
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", choices=(*SCENARIOS, "slot"), action="append", help="run only this scenario (repeatable)"
    )
    parser.add_argument("--events", type=int, default=200, help="duplicates for one node (200)")
    parser.add_argument("--spread", type=float, default=10.0, help="seconds the duplicates span (10)")
    parser.add_argument("--nodes", type=int, default=20, help="nodes faulting at once (20)")
    parser.add_argument("--within", type=float, default=4.0, help="seconds those faults span (4)")
    parser.add_argument("--limit", type=int, default=2, help="max_out_of_service for them (2)")
    parser.add_argument("--kills", type=int, default=20, help="kill -9 of a replica (20)")
    parser.add_argument("--kill-nodes", type=int, default=12, help="nodes faulting during the kills (12)")
    parser.add_argument(
        "--slot-bound",
        type=float,
        default=400.0,
        help="slot: how long to wait for the other node's action (400 s)",
    )
    parser.add_argument("--json", type=Path, help="also write every figure as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress on standard error")
    args = parser.parse_args()
    only = args.only or list(SCENARIOS)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per POST otherwise
    admin = os.environ.get("MEDIC_TEST_POSTGRES", DEFAULT_ADMIN_URL)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    results: dict[str, Any] = {}
    sections = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="medic-bench-replicas-") as tmp:
        work = Path(tmp)
        with prefect_on_postgres(work / "prefect", admin) as api, Harness.running(work, admin, api) as h:
            logging.info("parts up in %.0f s", time.monotonic() - began)
            if "duplicates" in only:
                a = duplicate_storm(h, events=args.events, spread_s=args.spread)
                results["duplicates"], sections = a, [*sections, duplicates_section(a)]
            if "simultaneous" in only:
                b = simultaneous_faults(h, count=args.nodes, within_s=args.within, limit=args.limit)
                results["simultaneous"], sections = b, [*sections, simultaneous_section(b)]
            if "kills" in only:
                c = kill_storm(h, kills=args.kills, count=args.kill_nodes)
                results["kills"], sections = c, [*sections, kills_section(c)]
            if "slot" in only:
                d = kill_slot_holder(h, bound_s=args.slot_bound)
                results["slot"], sections = d, [*sections, slot_section(d)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"## Reliability: two replicas ({cores} cores, {time.monotonic() - began:.0f} s in all)\n")
    print("\n".join(sections))
    if args.json:
        args.json.write_text(dump({name: _figures(r) for name, r in results.items()}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
