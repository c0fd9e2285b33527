"""The store's alembic scripts (medic/store/migrate.py runs them): env.py, the revisions in versions/,
and the frozen baseline schema they start from."""
