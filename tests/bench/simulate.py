"""`medic simulate` speed: 54 simulated days of one training job on 16,384 and 100,000 GPUs.

Each repeat is a whole run (`medic.whatif.fleetsim.simulate`) with the default policy, the same seed
every time: the failure draws, the incidents decided by the real engine, the guardrails and the
accounting. The policy is loaded once, outside the timing, as `medic simulate` loads it once per
run. The target is 100,000 GPUs x 54 days in 30 s or less, the same report for the same seed.
"""

from __future__ import annotations

import time
from typing import Any

from bench import REPO_ROOT
from bench.report import Stats, num, table
from medic.policy import load_policy
from medic.whatif.fleetsim import SimParams, measured, simulate

DEFAULT_POLICY = REPO_ROOT / "policies" / "default.yaml"
SIZES = (16_384, 100_000)
DAYS = 54.0
SEED = 1
ROUNDS = 5
TARGET_S = 30.0  # for 100,000 GPUs


def run() -> dict[str, Any]:
    loaded = load_policy(DEFAULT_POLICY)
    results: dict[str, Any] = {"rows": []}
    for gpus in SIZES:
        params = measured(SimParams(gpus=gpus, days=DAYS))  # `medic simulate`'s default durations
        samples, reports = [], []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            reports.append(simulate(params, loaded, SEED))
            samples.append(time.perf_counter() - start)
        first = reports[0]
        results["rows"].append(
            {
                "gpus": gpus,
                "seconds": Stats.of(samples),
                "identical": all(r.to_dict() == first.to_dict() for r in reports),
                "interruptions": first.interruptions,
                "decided": first.decided,
                "asked": first.asked,
                "goodput": first.goodput,
            }
        )
    return results


def section(results: dict[str, Any]) -> str:
    rows = []
    for row in results["rows"]:
        seconds: Stats = row["seconds"]
        rows.append(
            [
                f"{row['gpus']:,}",
                f"**{num(seconds.median)} s**",
                f"{num(seconds.low)} - {num(seconds.high)} s",
                f"{row['interruptions']:,}",
                f"{row['decided']} / {row['asked']:,}",
                f"{row['goodput']:.2%}",
                "yes" if row["identical"] else "**no**",
            ]
        )
    big = next(r for r in results["rows"] if r["gpus"] == max(SIZES))
    verdict = "meets" if big["seconds"].high <= TARGET_S and big["identical"] else "does not meet"
    return "\n".join(
        [
            "## Fleet simulator (`medic simulate`)",
            "",
            f"One whole `medic.whatif.fleetsim.simulate` run per repeat: {DAYS:g} simulated days, the default policy,",
            f"seed {SEED}, the measured recovery durations (`medic simulate`'s default), {ROUNDS} repeats per size,",
            "in one process. Incidents are decided by the real engine",
            "(`correlate`, `facts_of`, `decide`) once per distinct shape (signature, node history, diagnostics so",
            "far); the guardrails run on every decision.",
            "",
            table(
                [
                    "GPUs",
                    "seconds per run (median)",
                    "min - max",
                    "interruptions",
                    "incidents decided / decisions",
                    "goodput",
                    "same report each repeat",
                ],
                rows,
            ),
            "",
            f"Target: {max(SIZES):,} GPUs x {DAYS:g} days in ≤ {TARGET_S:g} s, deterministic for a seed — this run",
            f"**{verdict}** it (slowest repeat {num(big['seconds'].high)} s).",
        ]
    )
