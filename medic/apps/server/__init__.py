"""The HTTP ingest service, `medic serve`, and its client, `medic emit` (docs/serve.md)."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8787
