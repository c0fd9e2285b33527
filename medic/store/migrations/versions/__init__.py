"""The revisions, oldest first by name; alembic orders them by their `down_revision`."""
