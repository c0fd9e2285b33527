"""Prefect flows: one remediation flow run per incident."""
