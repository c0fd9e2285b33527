"""Entry points: the `medic` CLI, the HTTP ingest service, the node agent and the Slurm hooks.

The top layer. Each reads configuration and wires backends, then hands the work to the flows and
the domain; nothing imports from here (import-linter's contracts in pyproject.toml say so).
"""
