"""Every request outcome carries the fingerprint of the request that produced it, so a caller whose key
names a different request is told so instead of being handed someone else's outcome; and the columns that
count stock are 64-bit on PostgreSQL (SQLite's INTEGER already is).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# Columns that count units: a SKU restocked often enough outgrows 32 bits long before anything else.
_UNIT_COLUMNS = {
    "stock": ("on_hand", "reserved", "available"),
    "reservations": ("quantity",),
    "pending_reservations": ("quantity",),
    "sku_history": ("quantity", "on_hand_delta", "reserved_delta"),
}


def upgrade() -> None:
    # Nullable: outcomes written before this revision have no fingerprint and are judged by operation.
    op.add_column("request_outcomes", sa.Column("fingerprint", sa.String(64), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        for table, columns in _UNIT_COLUMNS.items():
            for column in columns:
                op.alter_column(table, column, type_=sa.BigInteger, existing_type=sa.Integer)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table, columns in _UNIT_COLUMNS.items():
            for column in columns:
                op.alter_column(table, column, type_=sa.Integer, existing_type=sa.BigInteger)
    with op.batch_alter_table("request_outcomes") as batch:
        batch.drop_column("fingerprint")
