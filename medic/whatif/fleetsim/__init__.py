"""`medic simulate`: a discrete-event model of a training fleet, remediated by a real policy.

Pure: parameters, a policy and a seed in, a report out (docs/simulate.md); the one file read is the
measurement the package ships. `params` holds what the fleet is and how long things take,
`measured` the recovery durations measured on a real Slurm cluster, `failures` what fails and what
fixes it, `decisions` the policy engine deciding simulated incidents, `loop` the event loop,
`report` what it cost.
"""

from medic.whatif.fleetsim.loop import mtbf_by_size, simulate
from medic.whatif.fleetsim.params import SimParams, fast_checkpointer, measured, meta_like_recovery
from medic.whatif.fleetsim.report import BADPUT, Report

__all__ = [
    "BADPUT",
    "Report",
    "SimParams",
    "fast_checkpointer",
    "measured",
    "meta_like_recovery",
    "mtbf_by_size",
    "simulate",
]
