"""The audit chain: the ledger `audit_chain`, the prune records `audit_prunes`, and an entry sealing
each row already in the store (docs/store.md#tamper-evidence).

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import context, op

from medic.store import ledger
from medic.store.chain import AUDITED, row_digest
from medic.store.migrations import baseline
from medic.store.types import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# The tables this revision seals, in this order, each by primary key: the same store gives the same
# chain. A later revision that audits another table seals that table's rows itself.
SEALED = ("incidents", "events", "steps", "diagnostics", "decisions", "actions", "approvals", "breaker")
_BATCH = 5000


def upgrade() -> None:
    op.create_table(
        "audit_chain",
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("table_name", sa.String, nullable=False),
        sa.Column("row_key", sa.String, nullable=False),
        sa.Column("incident_id", sa.String),
        sa.Column("digest", sa.String),
        sa.Column("prev_hash", sa.String, nullable=False),
        sa.Column("incident_prev_hash", sa.String),
        sa.Column("key_id", sa.String),
        sa.Column("hash", sa.String, nullable=False),
    )
    op.create_index("ix_audit_chain_incident", "audit_chain", ["incident_id", "seq"])
    op.create_index("ix_audit_chain_row", "audit_chain", ["table_name", "row_key", "seq"])
    op.create_table(
        "audit_prunes",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("pruned_at", UTCDateTime(), nullable=False),
        sa.Column("before", UTCDateTime(), nullable=False),
        sa.Column("archive", sa.String, nullable=False),
        sa.Column("archive_sha256", sa.String, nullable=False),
        sa.Column("incidents", sa.Integer, nullable=False),
        sa.Column("rows", sa.Integer, nullable=False),
        sa.Column("entries", sa.Integer, nullable=False),
        sa.Column("head_seq", sa.BigInteger, nullable=False),
        sa.Column("head_hash", sa.String, nullable=False),
        sa.Column("runs", sa.JSON, nullable=False),
    )
    _seal_existing_rows()


def _seal_existing_rows() -> None:
    connection = op.get_bind()
    key = context.config.attributes.get("audit_key")
    for name in SEALED:
        spec = AUDITED[name]
        table = baseline.METADATA.tables[name]  # its columns as of revision 0001, times in UTC
        rows = connection.execute(sa.select(table).order_by(table.c.id)).mappings()
        while batch := rows.fetchmany(_BATCH):
            changes = [
                ledger.Change(
                    name, str(row["id"]), row[spec.incident] if spec.incident else None, row_digest(spec, row)
                )
                for row in batch
            ]
            ledger.append(connection, changes, key)
