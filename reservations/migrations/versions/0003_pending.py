"""Pending reservations: requests of a SKU whose lease was busy, waiting to be served in a batch by
whoever holds that lease.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pending_reservations",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True
        ),
        sa.Column("key", sa.String(200), nullable=False, unique=True),
        sa.Column("sku", sa.String(64), nullable=False),
        sa.Column("quantity", sa.Integer, nullable=False),
        sa.Column("hold_ms", sa.BigInteger),
        sa.Column("task_id", sa.String(64)),
        sa.Column("epochs", sa.Integer, nullable=False),
        sa.Column("enqueued_ms", sa.BigInteger, nullable=False),
        sa.CheckConstraint("quantity > 0", name="ck_pending_reservations_quantity_positive"),
    )
    op.create_index("ix_pending_reservations_sku_id", "pending_reservations", ["sku", "id"])


def downgrade() -> None:
    op.drop_table("pending_reservations")
