"""Prefect tasks: thin wrappers that call the domain and the integrations and record each step."""
