"""A SQL lease remembers whether another acquirer found it busy while it was held, so its release can tell
the holder whether anyone handed it work meanwhile (a reservation task then looks at its SKU's queue only
when someone did).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # True for rows that exist already: a lease held across the upgrade may have had acquirers turned
    # away, and only its holder's look at its queue would find their work.
    op.add_column(
        "fencing_leases",
        sa.Column("contended", sa.Boolean, nullable=False, server_default=sa.true()),
    )


def downgrade() -> None:
    with op.batch_alter_table("fencing_leases") as batch:
        batch.drop_column("contended")
