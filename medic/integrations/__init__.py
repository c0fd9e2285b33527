"""Outside systems, each behind a small Protocol (medic/protocols.py)."""
