"""Outside systems, each behind a small Protocol (integrations/protocols.py)."""
