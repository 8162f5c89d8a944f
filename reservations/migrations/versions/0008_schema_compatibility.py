"""The schema says which code may run on it: a worker checks the database's revision before it takes
tasks, and one whose code is older than the schema starts only when the migrations since its own newest
revision declared themselves compatible with it (``oldest_compatible_code``, recorded by env.py in
``schema_compatibility``).

A migration declares ``oldest_compatible_code = "<revision>"`` when code built for that revision still
runs correctly on the schema it leaves: it only adds what older code never reads (a table, a nullable
column, an index). Without the declaration only code that knows the migration itself may run.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# A new table that code of revision 0007 never reads.
oldest_compatible_code = "0007"


def upgrade() -> None:
    op.create_table(
        "schema_compatibility",
        sa.Column("revision", sa.Text, primary_key=True),
        sa.Column("oldest_code", sa.Text, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("schema_compatibility")
