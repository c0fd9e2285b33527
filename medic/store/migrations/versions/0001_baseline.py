"""Baseline: the schema of the last release before alembic (medic/store/migrations/baseline.py).

On an empty store it creates every table; on a store an earlier release wrote, it adds what that
release lacked. Either way the store leaves it with the baseline schema, stamped.

Revision ID: 0001
Revises:
"""

from alembic import op

from medic.store.migrations import baseline

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    baseline.bring_up(op.get_bind())
