"""Node groups and modes (decision 0017): each decision's mode and group, and `mode_changes`, the audited
record of every change of a group's mode. The new columns are NULL on older rows, so the digests the
audit chain sealed them with still hold; the new table starts empty, so it has nothing to seal.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

from medic.store.types import UTCDateTime

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("decisions") as batch:
        batch.add_column(sa.Column("mode", sa.String))
        batch.add_column(sa.Column("node_group", sa.String))
    op.create_table(
        "mode_changes",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("changed_at", UTCDateTime(), nullable=False),
        sa.Column("node_group", sa.String, nullable=False),
        sa.Column("mode", sa.String),
        sa.Column("previous", sa.String),
        sa.Column("by", sa.String, nullable=False),
        sa.Column("policy_path", sa.String, nullable=False),
        sa.Column("policy_sha256", sa.String, nullable=False),
        sa.UniqueConstraint("node_group", "policy_sha256"),
    )
