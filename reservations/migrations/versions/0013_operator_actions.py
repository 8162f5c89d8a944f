"""The operator action log (``operator_actions``): each action taken by hand on a request or a SKU, with
who took it, when and why (reservations.actions).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# A new table that workers and front doors of 0012 never read nor write.
oldest_compatible_code = "0009"


def upgrade() -> None:
    op.create_table(
        "operator_actions",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True
        ),
        sa.Column("at_ms", sa.BigInteger, nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("target", sa.String(200), nullable=False),
        sa.Column("by", sa.String(200), nullable=False),
        sa.Column("reason", sa.String(500), nullable=False),
        sa.Column("detail", sa.Text, nullable=True),
    )
    op.create_index("ix_operator_actions_at_ms", "operator_actions", ["at_ms"])
    op.create_index("ix_operator_actions_target", "operator_actions", ["target"])


def downgrade() -> None:
    op.drop_table("operator_actions")
