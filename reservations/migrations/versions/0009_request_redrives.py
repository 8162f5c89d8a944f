"""Re-drives of dead-lettered requests: ``request_redrives`` links a dead-lettered request's key to the
request that drives it again under a key of its own, numbered per origin, with when and by whom.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# A new table that code of revision 0008 never reads: such workers keep serving (their dead letters
# just carry no arguments, and the command line refuses to re-drive those).
oldest_compatible_code = "0008"


def upgrade() -> None:
    op.create_table(
        "request_redrives",
        sa.Column("redrive_key", sa.String(200), primary_key=True),
        sa.Column("origin_key", sa.String(200), nullable=False),
        sa.Column("number", sa.Integer, nullable=False),
        sa.Column("operation", sa.String(32), nullable=False),
        sa.Column("at_ms", sa.BigInteger, nullable=False),
        sa.Column("by", sa.String(200), nullable=True),
        sa.UniqueConstraint("origin_key", "number", name="uq_request_redrives_origin_number"),
    )


def downgrade() -> None:
    op.drop_table("request_redrives")
