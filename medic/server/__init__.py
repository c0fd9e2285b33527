"""The HTTP ingest service, `medic serve` (docs/serve.md)."""
