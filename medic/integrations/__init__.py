"""Outside systems, each behind a small Protocol (medic/protocols.py)."""

# The repository's integrations/ links here: with the root on sys.path this file would load a second time as
# `integrations`, a second copy of every module and its state (docs/decisions/0012).
if __name__ != "medic.integrations":
    raise ImportError(f"{__name__} is medic.integrations: import it by that name (docs/decisions/0012)")
