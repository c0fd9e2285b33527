"""The outbox: chat messages on their way, kept until delivered or given up, so that a process that
stops or dies leaves them to the next start or another replica (docs/slack.md). Not audited: no rows
to seal.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

from medic.store.types import UTCDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("incident_id", sa.String, nullable=False),
        sa.Column("stage", sa.String, nullable=False),
        sa.Column("message", sa.JSON),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("parent_id", sa.Integer),
        sa.Column("status", sa.String, nullable=False),
        sa.Column("tries", sa.Integer, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("ref", sa.String),
        sa.Column("owner", sa.String),
        sa.Column("lease_until", UTCDateTime()),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("settled_at", UTCDateTime()),
    )
    op.create_index("ix_outbox_incident_id", "outbox", ["incident_id"])
    op.create_index("ix_outbox_status", "outbox", ["status"])
