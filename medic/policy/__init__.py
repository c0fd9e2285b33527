"""Policies: the YAML rules SREs edit, their schema, loader and the pure decision engine."""

from medic.policy.engine import decide
from medic.policy.loader import LoadedPolicy, PolicyError, load_policy
from medic.policy.model import Action, Classification, Decision, Policy
from medic.policy.selectors import Mode

__all__ = [
    "Action",
    "Classification",
    "Decision",
    "LoadedPolicy",
    "Mode",
    "Policy",
    "PolicyError",
    "decide",
    "load_policy",
]
