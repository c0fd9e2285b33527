"""`Diagnostics` over the simulated fleet: scripted DCGM outcomes per node and level."""

from __future__ import annotations

from datetime import UTC, datetime

from integrations.sim.fleet import SimFleet
from medic.protocols import DiagnosticResult


class SimDiagnostics:
    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    def run(self, node: str, level: int, timeout_s: float) -> DiagnosticResult:
        started = datetime.now(UTC)
        with self.fleet.lock:
            self.fleet.record_call(node, f"diagnose-l{level}")
            script = self.fleet.diagnostic_script.get((node, level))
            result, errors = script.popleft() if script else ("pass", ())
        detail = f"simulated DCGM level {level}: {result}" + (f" ({', '.join(errors)})" if errors else "")
        return DiagnosticResult(node, level, result, errors, detail, started, datetime.now(UTC))
