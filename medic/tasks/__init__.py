"""Prefect tasks: thin wrappers that call the domain and the integrations and record each step."""

# The repository's tasks/ links here: with the root on sys.path this file would load a second time as
# `tasks`, a second copy of every module and its state (docs/decisions/0012).
if __name__ != "medic.tasks":
    raise ImportError(f"{__name__} is medic.tasks: import it by that name (docs/decisions/0012)")
