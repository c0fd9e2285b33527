"""Events the differential absorbed as another's evidence (a victim's crash, a hang's timeouts) name the
event that explains them, `events.explained_by`: no incident holds them, and a start hands on only
the events in no incident that nothing explains. NULL on older rows, so the digests the audit chain
sealed them with still hold.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("events") as batch:
        batch.add_column(sa.Column("explained_by", sa.String))
