"""Prefect flows: one remediation flow run per incident."""

# The repository's flows/ links here: with the root on sys.path this file would load a second time as
# `flows`, a second copy of every module and its state (docs/decisions/0012).
if __name__ != "medic.flows":
    raise ImportError(f"{__name__} is medic.flows: import it by that name (docs/decisions/0012)")
