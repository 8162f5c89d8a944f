"""Requests: the one final outcome per idempotency key, and the log of attempts (lost ownership,
busy leases, transient failures) that led to it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "request_outcomes",
        sa.Column("key", sa.String(200), primary_key=True),
        sa.Column("operation", sa.String(32), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("task_id", sa.String(64)),
        sa.Column("worker", sa.String(200)),
        sa.Column("epochs", sa.Integer, nullable=False),
        sa.Column("at_ms", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "task_attempts",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True
        ),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("operation", sa.String(32), nullable=False),
        sa.Column("task_id", sa.String(64)),
        sa.Column("worker", sa.String(200)),
        sa.Column("token", sa.BigInteger),
        sa.Column("result", sa.String(32), nullable=False),
        sa.Column("detail", sa.Text),
        sa.Column("at_ms", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_task_attempts_key_id", "task_attempts", ["key", "id"])


def downgrade() -> None:
    op.drop_table("task_attempts")
    op.drop_table("request_outcomes")
