"""`Diagnostics` over the simulated fleet: scripted DCGM outcomes per node and level.

A level passes unless a failure was scripted for it; a node that is not in the fleet gets an
"error" result, never a pass.
"""

from __future__ import annotations

from datetime import UTC, datetime

from medic.integrations.sim.fleet import SimFleet, UnknownSimNodeError
from medic.protocols import DiagnosticResult


class SimDiagnostics:
    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    def run(self, node: str, level: int, timeout_s: float) -> DiagnosticResult:
        started = datetime.now(UTC)
        with self.fleet.lock:
            if not self.fleet.has_node(node):
                # Never a pass for a node the simulation does not have: an error, as DCGM's own
                # failures are, so the flow escalates and verification never reintegrates it.
                why = str(UnknownSimNodeError(node, list(self.fleet.nodes)))
                return DiagnosticResult(node, level, "error", (), why, started, datetime.now(UTC))
            self.fleet.record_call(node, f"diagnose-l{level}")
            script = self.fleet.diagnostic_script.get((node, level))
            result, errors = script.popleft() if script else ("pass", ())
        detail = f"simulated DCGM level {level}: {result}" + (f" ({', '.join(errors)})" if errors else "")
        return DiagnosticResult(node, level, result, errors, detail, started, datetime.now(UTC))
